"""A GGUF file converted to a Hugging Face model directory, through transformers, which
reads and dequantises a GGUF (with the `gguf` package) but refuses to `save_pretrained` it:
the pieces are written one by one here (`model.safetensors` without a tied
`lm_head.weight`, `config.json` without its `quantization_config`, `generation_config.json`,
the tokenizer and its `chat_template.jinja`). Only this module of `modeldir/` imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16")
FILE_MODE = 0o644   # safetensors writes 0600; the directory is shared by servers and users


@dataclass(frozen=True)
class Conversion:
    """What `convert_gguf` wrote: the number of tensors in `model.safetensors`, the
    architecture (`config.architectures[0]`) and the files with their sizes."""

    num_tensors: int
    architecture: str
    file_bytes: dict[str, int]


def _load(gguf_dir: Path, gguf_name: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    # In bfloat16 transformers warns that its packed-GGUF kernels are fastest in float32:
    # true of running the loaded model, beside the point for writing its weights out.
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                     dtype=getattr(torch, dtype))
    finally:
        logging.set_verbosity(verbosity)
    # transformers leaves the tokenizer's length unbounded when reading a GGUF; the model's
    # own context is what a Hugging Face directory of it states.
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_dir, gguf_file=gguf_name,
        model_max_length=model.config.max_position_embeddings)
    return tokenizer, model


def _write_weights(model, out: Path) -> int:
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return len(tensors)


def _write_configs(model, tokenizer, out: Path) -> None:
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def convert_gguf(gguf_dir: Path, gguf_name: str, out: Path, dtype: str) -> Conversion:
    """Convert `gguf_dir / gguf_name` into the existing empty directory `out`, weights in
    `dtype` (one of DTYPES)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    tokenizer, model = _load(Path(gguf_dir), gguf_name, dtype)
    num_tensors = _write_weights(model, out)
    _write_configs(model, tokenizer, out)
    file_bytes = {}
    for path in sorted(out.iterdir()):
        path.chmod(FILE_MODE)
        file_bytes[path.name] = path.stat().st_size
    return Conversion(num_tensors=num_tensors, architecture=type(model).__name__,
                      file_bytes=file_bytes)
