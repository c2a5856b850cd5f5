"""Device check: the SGLang driver against a real SGLang server (issue #20), on a GPU machine.

    python -m benchmarks.device_check_sglang [--model DIR] [--group-size 8]

Where SGLang is not installed, or there is no CUDA device, it says why, writes that to
`benchmarks/results/device_check_sglang.json` and exits 0 (a skip). Otherwise it starts SGLang
with the `sglang` launcher (`--enable-deterministic-inference`), a gateway in this process in
front of it, and checks on the real server what the faithful test server
(`tests/engines/sglang_faithful.py`) encodes:
- a GRPO group: `--group-size` sessions of one group send one prompt (temperature 1, no
  seed): the completions are all distinct, and each call's recorded seed replays it;
- the control: the same prompt sent to `/generate` without `sampling_seed`, past the driver,
  gives one completion for all (SGLang's seed 42 in deterministic mode);
- `health()` answers during an `in_place` pause, and a weight update during that pause with
  a request held completes with the new version, the request finishing after `resume`.
It prints a Markdown table and writes the JSON; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import aiohttp

RESULTS = Path(__file__).parent / "results" / "device_check_sglang.json"
ADMIN_TOKEN = "device-check-admin-token"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return f"SGLang is not installed in {sys.prefix} (pip install 'undertow[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: SGLang needs one"
    return None


async def group_of_sessions(url: str, model_dir: Path, store_dir: Path,
                            group_size: int) -> dict:
    """`group_size` sessions with one prompt through a gateway; their completions and seeds."""
    from aiohttp import web

    from undertow.gateway.front.app import STORE_KEY, create_app
    from undertow.gateway.front.config import GatewayConfig

    app = create_app(GatewayConfig(model_dir=model_dir, store_dir=store_dir,
                                   engine_urls=(url,), admin_token=ADMIN_TOKEN))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gateway = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(group_size):
                async with http.post(gateway + "/admin/sessions", json={"group": "grpo"},
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                    session = await r.json()
                async with http.post(
                        session["base_url"] + "/chat/completions",
                        headers={"Authorization": f"Bearer {session['api_key']}"},
                        json={"model": "m", "messages": MESSAGES, "max_tokens": 32,
                              "temperature": 1.0}) as reply:
                    if reply.status != 200:
                        raise RuntimeError(f"chat answered {reply.status}: {await reply.text()}")
        tree = app[STORE_KEY].tree("grpo")
        return {"completions": [_completion(tree, call) for call in tree.calls],
                "seeds": [call.meta["sampling"]["sampling_seed"] for call in tree.calls]}
    finally:
        await runner.cleanup()


def _completion(tree, call) -> list[int]:
    token_ids = [t for node_id in tree.path(call.leaf) for t in tree.nodes[node_id].token_ids]
    return token_ids[len(token_ids) - call.num_completion_tokens:]


async def unseeded_control(url: str, group_size: int) -> int:
    """Distinct completions of one prompt sent without a seed, past the driver."""
    body = {"text": "Write a short poem about the sea.",
            "sampling_params": {"max_new_tokens": 32, "temperature": 1.0}}
    async with aiohttp.ClientSession() as http:
        outputs = []
        for _ in range(group_size):
            async with http.post(url + "/generate", json=body) as reply:
                outputs.append(tuple((await reply.json())["output_ids"]))
    return len(set(outputs))


async def pause_and_update(client, model_dir: Path) -> dict:
    """health() during an in_place pause; an update then, with a request held."""
    from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams

    held = asyncio.create_task(client.generate(GenerateRequest(
        text="Count from one to a hundred:", rid="device-check-held",
        sampling_params=SamplingParams(max_new_tokens=256, ignore_eos=True))))
    await asyncio.sleep(0.5)
    await client.pause("in_place")
    healthy = await client.health()
    await client.update_weights_from_disk(str(model_dir), "device-check-1")
    version = (await client.model_info()).weight_version
    await client.resume()
    result = await held
    return {"healthy_while_paused": healthy, "version_after_update": version,
            "held_finish": result.finish_reason.type, "held_tokens": len(result.output_ids)}


async def run(model_dir: Path, group_size: int) -> dict:
    from undertow.gateway.engines.launch import SGLangLauncher, launch_engine

    with tempfile.TemporaryDirectory() as work:
        async with launch_engine(SGLangLauncher(), model_dir,
                                 log_path=Path(work) / "sglang.log") as engine:
            group = await group_of_sessions(engine.url, model_dir, Path(work) / "store",
                                            group_size)
            control = await unseeded_control(engine.url, group_size)
            async with engine.driver() as client:
                update = await pause_and_update(client, model_dir)
    num_distinct = len({tuple(c) for c in group["completions"]})
    checks = {
        "group: distinct completions": (num_distinct, num_distinct == group_size),
        "group: distinct recorded seeds": (len(set(group["seeds"])),
                                           len(set(group["seeds"])) == group_size),
        "control: distinct without seeds": (control, True),
        "health during in_place pause": (update["healthy_while_paused"],
                                         update["healthy_while_paused"]),
        "version after update in pause": (update["version_after_update"],
                                          update["version_after_update"] == "device-check-1"),
        "held request after resume": (f"{update['held_finish']} ({update['held_tokens']})",
                                      update["held_finish"] == "length"),
    }
    return {"group_size": group_size, "checks": {name: {"value": value, "ok": ok}
                                                 for name, (value, ok) in checks.items()}}


def table(result: dict) -> str:
    lines = ["| check | value | ok |", "| --- | --- | --- |"]
    lines += [f"| {name} | {check['value']} | {'yes' if check['ok'] else 'NO'} |"
              for name, check in result["checks"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: the tiny model, built here)")
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    reason = skip_reason()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        RESULTS.write_text(json.dumps({"skipped": reason}, indent=2) + "\n")
        return 0
    model_dir = args.model
    if model_dir is None:
        from undertow.learner.modeldir import init_model_dir

        model_dir = init_model_dir(Path(tempfile.mkdtemp()) / "tiny", size="tiny", seed=0)
    result = asyncio.run(run(model_dir, args.group_size))
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0 if all(check["ok"] for check in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
