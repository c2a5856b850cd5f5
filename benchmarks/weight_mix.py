"""A start policy between a model and its fine-tune: base + alpha * (tuned - base).

    python -m benchmarks.weight_mix --base DIR --tuned DIR --alpha 0.5 --out DIR

Linear interpolation of weights (as in WiSE-FT, Wortsman et al. 2022) gives a policy
between the two without training again: an SFT that fitted its gold sessions to 0.015
nats per token samples one session per instance, so an RL group of it is uniform and
learns nothing; part of the way back to the base keeps what SFT taught of the format
and spreads the samples. Every tensor is mixed in float32 and written in the tuned
model's dtype; the tuned directory's other files (config, tokenizer, chat template) are
copied beside it.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

WEIGHTS = "model.safetensors"
NOT_COPIED = {WEIGHTS, "metrics.jsonl"}


def mix(base: Path, tuned: Path, alpha: float, out: Path) -> Path:
    """Writes the mixed model directory `out`; ValueError when the two models' tensors
    differ in name or shape."""
    from safetensors.torch import load_file, save_file

    base_tensors, tuned_tensors = load_file(base / WEIGHTS), load_file(tuned / WEIGHTS)
    if base_tensors.keys() != tuned_tensors.keys():
        raise ValueError(f"{base} and {tuned} hold different tensors: "
                         f"{sorted(base_tensors.keys() ^ tuned_tensors.keys())[:5]}")
    mixed = {}
    for name, tuned_tensor in tuned_tensors.items():
        start = base_tensors.pop(name)
        if start.shape != tuned_tensor.shape:
            raise ValueError(f"{name}: shape {tuple(start.shape)} in {base}, "
                             f"{tuple(tuned_tensor.shape)} in {tuned}")
        start = start.float()
        mixed[name] = start.add_(tuned_tensor.float() - start, alpha=alpha) \
            .to(tuned_tensor.dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for path in tuned.iterdir():
        if path.is_file() and path.name not in NOT_COPIED:
            shutil.copyfile(path, out / path.name)
    save_file(mixed, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--tuned", type=Path, required=True)
    parser.add_argument("--alpha", type=float, required=True,
                        help="0: the base, 1: the tuned model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(mix(args.base, args.tuned, args.alpha, args.out))


if __name__ == "__main__":
    main()
