"""Run configs of `undertow train -c`: `learn.yaml` (the default) and `swe.yaml`."""
