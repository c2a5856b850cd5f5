"""What the engine-side levers of the held-out learning benchmark buy, on its real prompts.

    python -m benchmarks.learning_levers [--model qwen2.5-coder-0.5b-instruct]
        [--dtype float32] [--threads 2] [--num-tasks 3]

One built-in engine on the model (`gateway.engines.launch`), driven through
`POST /v1/completions` with prompt token IDs rendered by the model's chat template
(transformers' `apply_chat_template`, what the gateway's token truth reproduces), greedy,
on held-out tasks of `learning_tasks.py` (difficulty line, seed 0):

- prompt length: the first prompt of a session under mini-swe-agent's swebench.yaml (its
  bash tool in the template), its swebench_backticks.yaml and this benchmark's
  `configs/learning_mini_swe_agent.yaml`: tokens, and the uncached prefill (one output
  token, the prefix cache flushed before);
- KV reuse across turns (the engine's radix prefix cache): a session's second call (the
  first prompt + a reply + the command's output) with its first call's prefix cached,
  against the same prompt after `/flush_cache`;
- batched sampling of a group's sessions: output tokens per second of 1, 4 and 8
  simultaneous requests of `--decode-tokens` tokens on the short prompts (each after a
  warm-up; distinct tasks, so no shared prefix).

Each figure is the best of `--num-tasks` tasks (the machine is shared: other work only ever
slows a round). Writes `benchmarks/results/learning_levers.json` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from jinja2 import Template

from benchmarks.engine import TIMEOUT, complete
from benchmarks.learner import resolve_model
from benchmarks.learning import AGENT_CONFIG
from benchmarks.learning_tasks import generate
from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine

RESULTS = Path(__file__).parent / "results" / "learning_levers.json"
REPLY = "```bash\nsed -i 's/return 8/return 36/' shopcalc/limits.py\n```"
OBSERVATION = "<returncode>0</returncode>\n<output>\n</output>"
CONCURRENCIES = (1, 4, 8)


def agent_prompts() -> dict[str, tuple[dict, bool]]:
    """Per prompt config: (its agent section, whether it sends mini-swe-agent's bash tool)."""
    stock = Path(importlib.util.find_spec("minisweagent").origin).parent / "config" / "benchmarks"

    def agent(path: Path) -> dict:
        return yaml.safe_load(path.read_text())["agent"]

    return {"swebench.yaml (tool call)": (agent(stock / "swebench.yaml"), True),
            "swebench_backticks.yaml": (agent(stock / "swebench_backticks.yaml"), False),
            "learning_mini_swe_agent.yaml": (agent(AGENT_CONFIG), False)}


def render(tokenizer, agent: dict, tool: bool, statement: str, second_turn: bool) -> list[int]:
    """A session's first prompt (or its second: + REPLY + OBSERVATION) as token IDs."""
    from minisweagent.models.utils.actions_toolcall import BASH_TOOL

    values = {"task": statement, "system": "Linux", "release": "", "version": "",
              "machine": "x86_64"}
    messages = [{"role": "system", "content": Template(agent["system_template"]).render()},
                {"role": "user", "content": Template(agent["instance_template"]).render(**values)}]
    if second_turn:
        messages += [{"role": "assistant", "content": REPLY},
                     {"role": "user", "content": OBSERVATION}]
    return tokenizer.apply_chat_template(messages, tools=[BASH_TOOL] if tool else None,
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


async def flush(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url + "/flush_cache") as reply:
        reply.raise_for_status()


async def prompt_rows(session, url: str, model: str, tokenizer, statements) -> list[dict]:
    """Per prompt config: first-prompt tokens and uncached prefill; the second call's time
    with the first call's prefix cached and flushed."""
    rows = []
    for name, (agent, tool) in agent_prompts().items():
        first_s, cached_s, flushed_s, lengths = [], [], [], []
        for statement in statements:
            first = render(tokenizer, agent, tool, statement, second_turn=False)
            second = render(tokenizer, agent, tool, statement, second_turn=True)
            lengths.append((len(first), len(second)))
            await flush(session, url)
            first_s.append((await complete(session, url, model, first, 1))[1])
            cached_s.append((await complete(session, url, model, second, 1))[1])
            await flush(session, url)
            flushed_s.append((await complete(session, url, model, second, 1))[1])
        rows.append({"prompt": name, "first_prompt_tokens": [a for a, _ in lengths],
                     "second_prompt_tokens": [b for _, b in lengths],
                     "first_prefill_s": min(first_s), "second_cached_s": min(cached_s),
                     "second_flushed_s": min(flushed_s)})
    return rows


async def decode_rows(session, url: str, model: str, prompts: list[list[int]],
                      decode_tokens: int) -> list[dict]:
    rows = []
    for concurrency in CONCURRENCIES:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        await asyncio.gather(*(complete(session, url, model, p, 4) for p in batch))
        started = time.perf_counter()
        results = await asyncio.gather(*(complete(session, url, model, p, decode_tokens)
                                         for p in batch))
        elapsed = time.perf_counter() - started
        rows.append({"concurrency": concurrency, "seconds": elapsed,
                     "tokens_per_s": sum(n for n, _ in results) / elapsed})
    return rows


async def measure(model_dir: Path, dtype: str, threads: int, num_tasks: int,
                  decode_tokens: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        _, heldout = generate(Path(scratch), num_instances=32, difficulty="line")
        rows = [json.loads(line) for line in (heldout / "tasks.jsonl").read_text().splitlines()]
    statements = [row["problem_statement"] for row in rows]  # 8 held-out tasks
    launcher = BuiltinLauncher(overrides={"dtype": dtype, "num_threads": threads})
    short_agent, _ = agent_prompts()["learning_mini_swe_agent.yaml"]
    async with launch_engine(launcher, model_dir) as engine, \
            aiohttp.ClientSession(timeout=TIMEOUT) as session:
        model = str(model_dir)
        prompts = await prompt_rows(session, engine.url, model, tokenizer,
                                    statements[:num_tasks])
        short = [render(tokenizer, short_agent, False, s, False) for s in statements]
        decode = await decode_rows(session, engine.url, model, short, decode_tokens)
    return {"prompts": prompts, "decode": decode}


def markdown(result: dict) -> str:
    lines = ["| prompt config | first prompt (tokens) | its prefill, uncached (s) | "
             "second call (tokens) | second call, first cached (s) | flushed (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in result["prompts"]:
        lines.append(f"| {row['prompt']} | {max(row['first_prompt_tokens'])} | "
                     f"{row['first_prefill_s']:.2f} | {max(row['second_prompt_tokens'])} | "
                     f"{row['second_cached_s']:.2f} | {row['second_flushed_s']:.2f} |")
    lines += ["", "| simultaneous requests | output tokens/s |", "|---:|---:|"]
    lines += [f"| {row['concurrency']} | {row['tokens_per_s']:.1f} |" for row in result["decode"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-tasks", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    result = asyncio.run(measure(resolve_model(args.model), args.dtype, args.threads,
                                 args.num_tasks, args.decode_tokens))
    record = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
              "load_average_1m": [load, os.getloadavg()[0]], **result}
    args.results.parent.mkdir(exist_ok=True)
    args.results.write_text(json.dumps(record, indent=2))
    print(markdown(result))
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; results: {args.results}")


if __name__ == "__main__":
    main()
