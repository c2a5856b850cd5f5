"""Whether a checkpoint fits the model the engines serve, read before any engine loads it.

A weight update (`weight_updates.py`) hands every engine a model directory. SGLang 0.5.23
loads it into the running model in place (`update_weights_from_disk`,
`srt/model_executor/model_runner_components/weight_updater.py`); a checkpoint of another
vocabulary fails an assertion in its weight loader, and the server exits. So the pool first
compares the checkpoint with the model directory the engines serve (`check_checkpoint`):
`config.json`'s architecture and vocabulary, then the tensors' names and shapes from the
safetensors headers (read with the `safetensors` library, no tensor loaded). A mismatch is
`IncompatibleCheckpoint`, naming it; no engine has been told anything.

The check needs both directories on this machine; where either is not (engines on other
hosts), it says so in the log and leaves the load to the engines.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors import safe_open

from undertow.gateway.engines.protocol import IncompatibleCheckpoint

log = logging.getLogger(__name__)

# A tied model's output head is its embedding: `save_pretrained` leaves it out or writes
# it, and either loads.
TIED_HEAD = "lm_head.weight"
NUM_NAMED = 3  # tensors named in a message, of each kind of mismatch


def check_checkpoint(serving_dir: Path, checkpoint_dir: Path) -> None:
    """Raises `IncompatibleCheckpoint` when `checkpoint_dir` cannot be loaded into the
    model served from `serving_dir` (see the module docstring)."""
    serving_dir, checkpoint_dir = Path(serving_dir), Path(checkpoint_dir)
    if not (serving_dir / "config.json").is_file() or not checkpoint_dir.is_dir():
        log.info("checkpoint %s not checked against %s: not both model directories on this "
                 "machine", checkpoint_dir, serving_dir)
        return
    if serving_dir.resolve() == checkpoint_dir.resolve():
        return
    serving, checkpoint = _config(serving_dir), _config(checkpoint_dir)
    problems = [f"{name} is {checkpoint.get(name)!r}, the served model's {serving.get(name)!r}"
                for name in ("architectures", "vocab_size")
                if serving.get(name) != checkpoint.get(name)]
    if not problems:
        problems = _tensor_problems(_shapes(serving_dir), _shapes(checkpoint_dir),
                                    tied=bool(serving.get("tie_word_embeddings")))
    if problems:
        raise IncompatibleCheckpoint(
            f"checkpoint {checkpoint_dir} does not fit the served model {serving_dir}: "
            f"{'; '.join(problems)}. No engine was given it; push a checkpoint of the same "
            "model (the engines' SGLang would crash loading this one)")


def _config(model_dir: Path) -> dict:
    """`config.json`, a multimodal model's `text_config` taking the vocabulary's place."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise IncompatibleCheckpoint(f"{model_dir} has no config.json: it is not a model "
                                     "directory (give the directory save_pretrained wrote)")
    config = json.loads(config_file.read_text())
    text = config.get("text_config") or {}
    return {**config, "vocab_size": config.get("vocab_size") or text.get("vocab_size")}


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the directory's safetensors files, from their headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for weight_file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weight_file), framework="numpy") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[name] = tuple(weights.get_slice(name).get_shape())
    return shapes


def _tensor_problems(serving: dict[str, tuple[int, ...]], checkpoint: dict[str, tuple[int, ...]],
                     tied: bool) -> list[str]:
    """What differs between the two sets of tensors (none compared where either directory
    holds no safetensors file)."""
    if not serving or not checkpoint:
        return []
    ignored = {TIED_HEAD} if tied else set()
    missing = sorted(serving.keys() - checkpoint.keys() - ignored)
    extra = sorted(checkpoint.keys() - serving.keys() - ignored)
    reshaped = [f"{name} {list(checkpoint[name])} (served: {list(serving[name])})"
                for name in sorted(serving.keys() & checkpoint.keys())
                if serving[name] != checkpoint[name]]
    problems = []
    for what, names in (("tensors missing", missing), ("tensors the served model has not",
                                                       extra), ("shapes differ", reshaped)):
        if names:
            shown = ", ".join(names[:NUM_NAMED]) + (f" and {len(names) - NUM_NAMED} more"
                                                    if len(names) > NUM_NAMED else "")
            problems.append(f"{what}: {shown}")
    return problems
