"""The wiring of one run: its config sections, the training run, the rollout source, the
embedded gateway and engine, the engine keeper, the warm start and the run report (see
docs/design.md, "From `undertow train` to the loss")."""
