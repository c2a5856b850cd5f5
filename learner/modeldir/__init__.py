"""Model directories built offline, `undertow model init`: `init_model_dir` writes a Hugging
Face-layout directory of a Qwen3 model with random weights from a seed and a byte-level BPE
tokenizer trained on a frozen snapshot of the repository's text (`corpus.py` ->
`tokenizer.py` -> configs sized by `sizes.py`, template of `chat_template.py` -> `weights.py`,
the only part that imports torch). transformers, SGLang and vLLM load it without a network.
"""

import json
from pathlib import Path

from undertow.learner.modeldir.chat_template import CHAT_TEMPLATE, render_chat
from undertow.learner.modeldir.sizes import (
    MAX_POSITION_EMBEDDINGS,
    ROPE_THETA,
    SIZES,
    ModelSize,
)
from undertow.learner.modeldir.tokenizer import (
    END_OF_TEXT,
    IM_END,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    train_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "SIZES", "ModelSize", "init_model_dir", "render_chat",
           "train_tokenizer", "write_model_config", "write_tokenizer_files"]

VOCAB_MULTIPLE = 64


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(model_dir: Path, tokenizer, max_length: int) -> None:
    """`tokenizer.json`, `tokenizer_config.json` (with the chat template) and the special map."""
    tokenizer.save(str(model_dir / "tokenizer.json"))
    added_tokens = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token in SPECIAL_TOKENS,
        }
        for token in (*SPECIAL_TOKENS, *TAG_TOKENS)
    }
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(model_dir / "special_tokens_map.json", {
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        # Not the tags: `skip_special_tokens` must keep them for the tool-call parser.
        "additional_special_tokens": list(SPECIAL_TOKENS),
    })


def write_model_config(model_dir: Path, size: ModelSize, tokenizer) -> None:
    """`config.json` and `generation_config.json` for a Qwen3 model of `size`."""
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    # The smallest multiple of 64 that holds every token: rows past the tokenizer
    # would be sampled by the untrained model and decode to nothing.
    vocab_size = -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if size.embedding_rows is not None:
        if size.embedding_rows < num_tokens:
            raise ValueError(f"embedding_rows={size.embedding_rows} is below the tokenizer's "
                             f"{num_tokens} tokens")
        vocab_size = size.embedding_rows
    end_of_text_id, im_end_id = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
    _write_json(model_dir / "config.json", {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": size.num_hidden_layers,
        "tie_word_embeddings": size.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": end_of_text_id,
        "eos_token_id": im_end_id,
        "pad_token_id": end_of_text_id,
        "dtype": "float32",
        "torch_dtype": "float32",
    })
    _write_json(model_dir / "generation_config.json", {
        "bos_token_id": end_of_text_id,
        "eos_token_id": [im_end_id, end_of_text_id],
        "pad_token_id": end_of_text_id,
    })


def init_model_dir(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a complete model directory of `size` (a key of SIZES) to `out`; return `out`.

    The tokenizer depends only on the frozen corpus (`corpus.py`; BPE has no randomness);
    the weights depend only on `size` and `seed`.
    """
    if size not in SIZES:
        raise ValueError(f"size={size!r} is unknown; choose one of {sorted(SIZES)}")
    from undertow.learner.modeldir.corpus import read_frozen_corpus
    from undertow.learner.modeldir.weights import write_weights

    model_size = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(read_frozen_corpus(), vocab_size=model_size.max_vocab_size)
    write_tokenizer_files(out, tokenizer, max_length=MAX_POSITION_EMBEDDINGS)
    write_model_config(out, model_size, tokenizer)
    write_weights(out, seed=seed)
    return out


def ensure_model_dir(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """`out`, built by `init_model_dir` unless it is complete already (its weights, which
    are written last, are there)."""
    out = Path(out)
    if not (out / "model.safetensors").exists():
        print(f"building the {size} model in {out} (once)", flush=True)
        init_model_dir(out, size=size, seed=seed)
    return out
