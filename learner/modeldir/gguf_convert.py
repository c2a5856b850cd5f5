"""A GGUF file converted to a Hugging Face model directory, through transformers.

transformers reads a GGUF (`from_pretrained(dir, gguf_file=NAME)`, which needs the `gguf`
package) and dequantises every tensor into a torch model, and builds the tokenizer and its
chat template from the GGUF's metadata. It refuses to `save_pretrained` such a model
("quantized with gguf ... not serializable"), so the pieces are written one by one here:
the state dict to `model.safetensors` (without `lm_head.weight` when the embeddings are
tied, as Hugging Face directories store them), `config.json` without the
`quantization_config` that marks the model as loaded from GGUF, `generation_config.json`,
and the tokenizer (`tokenizer.json`, `tokenizer_config.json`, the chat template in
`chat_template.jinja`). The values are the dequantised ones: exact in float32, rounded in
bfloat16. Only this module of `modeldir/` imports torch.
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

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # In bfloat16 transformers warns that its packed-GGUF kernels are fastest in float32:
    # true of running the loaded model, beside the point for writing its weights out.
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                     dtype=getattr(torch, dtype))
    finally:
        logging.set_verbosity(verbosity)
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
    # transformers leaves it unbounded when reading a GGUF; the model's own context is
    # what a Hugging Face directory of it states.
    tokenizer.model_max_length = config.max_position_embeddings
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
