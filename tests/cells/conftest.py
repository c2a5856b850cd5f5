"""Fixtures of the cell pool's tests: the learner's (one torch thread per test module, the
tiny model at float32 and its nearby reference, random group trees), shared with
`tests/learner/`."""

from tests.learner.conftest import (
    one_torch_thread,
    policy32,
    random_trees,
    reference32,
    tiny_untied_model_dir,
)

__all__ = ["one_torch_thread", "policy32", "random_trees", "reference32",
           "tiny_untied_model_dir"]
