"""Randomly initialised Qwen3 weights, written as `model.safetensors`.

torch and transformers are imported here, inside the function, so that the rest
of the package (tokenizer training, the chat template) works without them.
"""

from pathlib import Path


def write_weights(model_dir: Path, seed: int) -> Path:
    """Build `Qwen3ForCausalLM` from `model_dir/config.json` with weights drawn from `seed`.

    transformers' own initialisation is used (normal with `initializer_range`, norms
    at one), so that the logits of the untrained model vary with the input. The tied
    output embedding is not stored, as `save_pretrained` would do.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config.from_pretrained(model_dir)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    path = model_dir / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it private; engines may run as another user
    return path
