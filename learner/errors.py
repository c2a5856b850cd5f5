"""Errors of the learner's training path (packing, losses, advantages, model).

    LearnerError             base of everything the training path raises
    ├── EmptyStepError       a step (or a session set) has no trainable token
    ├── RunFailedError       groups in a row lost every session to failures of Undertow
    ├── MicroBatchTooLongError  (also a ValueError) a path longer than the micro-batch bound
    └── LossConfigError      (also a ValueError) an unknown loss, correction or bad parameter
"""


class LearnerError(Exception):
    """Base of the training path's errors."""


class EmptyStepError(LearnerError):
    """A step has no trainable token: the loss mask would be all zero, which would
    train nothing while looking like a normal step."""


class RunFailedError(LearnerError):
    """A training run cannot go on: `learner.max_failed_groups` groups in a row had
    every session failed by Undertow itself (image, sandbox, grading, gateway); the
    message names the cause and the last error."""


class MicroBatchTooLongError(LearnerError, ValueError):
    """Packing with `learner.long_paths: split` left a micro-batch longer than the
    micro-batch bound (a path with its context that does not fit); the message names
    `learner.long_paths: whole`, which trains such a path in segments."""


class LossConfigError(LearnerError, ValueError):
    """A loss configuration that names no known loss or correction, or a bad parameter."""
