"""Scripted engines: real aiohttp servers speaking SGLang's native `/generate` protocol
(non-incremental streaming, as SGLang does by default) that reply with scripted token
IDs instead of sampling a model.

- `ScriptedEngine` replays `scripts` in request order (then `default`). Tests of tool
  calls, thinking blocks and exact capture use it (the fake sits at the outer edge: the
  gateway's engine pool and client talk to it over HTTP as to any engine); it remembers
  what it sent for each `rid`, so tests can compare the tree with it, and what
  `/abort_request` named (`aborted`; a stream in flight that it names ends early, as
  SGLang's does). Fault switches: `delay_s` per token, `end_delay_s` before `[DONE]`.
- `ReplayEngine` replays one script per *session*, chosen from the prompt: the script
  whose `key` (e.g. the task's problem statement) the decoded prompt contains, and its
  k-th turn for a prompt that already holds k assistant turns. Sessions may interleave
  in any order. `undertow sft-collect` serves it to drive oracle trajectories through a
  real scaffold, so that the gateway stores exactly the oracle's token IDs as sampled
  tokens. Scripts are read from a JSONL file of `{"key": str, "turns": [[int, ...]]}`.

The reported logprobs are made up (small negative numbers); a scripted engine serves
trajectories to imitate or to test capture, never to estimate a policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

WEIGHT_VERSION = "7"
ASSISTANT_HEADER = "<|im_start|>assistant"


@dataclass
class Sent:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    sampling_params: dict


@dataclass
class ScriptedEngine:
    """Replays `scripts` in order (then `default`); `stop_token_ids` end a completion."""

    default: list[int]
    stop_token_ids: tuple[int, ...] = ()
    scripts: list[list[int]] = field(default_factory=list)
    sent: dict[str, Sent] = field(default_factory=dict)
    delay_s: float = 0.0
    end_delay_s: float = 0.0  # from the finishing event to `[DONE]`
    num_requests: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # what `/abort_request` named
    streaming: dict[str, bool] = field(default_factory=dict)  # rid -> aborted, while it streams
    max_body_bytes: int = 2**20  # aiohttp's default; a million-token prompt's JSON is ~6 MB
    keep_bodies: bool = False  # keep each `/generate` body's bytes in `bodies`, as received
    bodies: list[bytes] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.ok)
        app.router.add_post("/abort_request", self.abort_request)
        for path in ("/flush_cache", "/pause_generation", "/continue_generation"):
            app.router.add_post(path, self.ok)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        return app

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        """Notes what it names (SGLang's form: `{"rid"}`, or `{"abort_all": true}` as "");
        each stream in flight whose rid starts with it ends with `finish_reason` abort
        and the tokens sent so far, as SGLang's does."""
        body = await request.json()
        prefix = "" if body.get("abort_all") else str(body.get("rid") or "")
        self.aborted.append(prefix)
        for rid in self.streaming:
            self.streaming[rid] = self.streaming[rid] or rid.startswith(prefix)
        return web.json_response({"success": True})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "scripted", "weight_version": WEIGHT_VERSION})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": WEIGHT_VERSION})

    def next_script(self, input_ids: list[int]) -> list[int]:
        """The completion to send for a prompt (here: the next script in order)."""
        return self.scripts.pop(0) if self.scripts else list(self.default)

    def _completion(self, params: dict) -> tuple[list[int], dict]:
        script = self.next_script(self.prompt_ids)
        max_new = params.get("max_new_tokens")
        for index, token_id in enumerate(script):
            if token_id in self.stop_token_ids:
                script = script[:index + 1]
                if max_new is None or len(script) <= max_new:
                    return script, {"type": "stop", "matched": token_id}
                break
        if max_new is not None and len(script) >= max_new:
            return script[:max_new], {"type": "length", "length": max_new}
        return script, {"type": "stop", "matched": None}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.keep_bodies:
            self.bodies.append(await request.read())
        body = await request.json()
        self.num_requests += 1
        rid = body.get("rid") or f"r{self.num_requests}"
        params = body.get("sampling_params") or {}
        self.prompt_ids = list(body["input_ids"])  # read by `_completion`, no await between
        output_ids, finish = self._completion(params)
        logprobs = [-0.001 * self.num_requests - 0.01 * (i + 1) for i in range(len(output_ids))]
        self.sent[rid] = Sent(list(body["input_ids"]), output_ids, logprobs, params)

        def reply(num: int, done: bool) -> dict:
            return {"text": "", "output_ids": output_ids[:num], "meta_info": {
                "id": rid, "finish_reason": finish if done else None,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": num,
                "cached_tokens": 0, "weight_version": WEIGHT_VERSION,
                "output_token_logprobs": [[lp, t, None] for lp, t in
                                          zip(logprobs[:num], output_ids[:num], strict=True)]}}

        if not body.get("stream"):
            return web.json_response(reply(len(output_ids), True))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.streaming[rid] = False
        try:
            await self._stream(response, rid, finish, reply, len(output_ids))
        except ConnectionError:  # the gateway left: no reply to write (SGLang's is quiet too)
            pass
        finally:
            del self.streaming[rid]
        return response

    async def _stream(self, response: web.StreamResponse, rid: str, finish: dict, reply,
                      num_output: int) -> None:
        """One event per token, then the finishing one and `[DONE]`; an aborted stream
        ends early (`abort_request`)."""
        for num in range(1, num_output + 1):
            await asyncio.sleep(self.delay_s)
            if self.streaming[rid]:
                aborted = reply(num - 1, True)
                aborted["meta_info"]["finish_reason"] = {"type": "abort",
                                                         "message": "Abort by user request"}
                await response.write(f"data: {json.dumps(aborted)}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
                return
            await response.write(f"data: {json.dumps(reply(num, False))}\n\n".encode())
        await response.write(f"data: {json.dumps(reply(num_output, True))}\n\n".encode())
        if self.end_delay_s:
            await asyncio.sleep(self.end_delay_s)
        await response.write(b"data: [DONE]\n\n")


@dataclass(frozen=True)
class ReplayScript:
    """One session's completions: `turns[k]` answers the prompt holding k assistant
    turns, in a session whose prompt contains `key`."""

    key: str
    turns: tuple[tuple[int, ...], ...]

    def to_json(self) -> dict:
        return {"key": self.key, "turns": [list(turn) for turn in self.turns]}


def write_scripts(path: Path, scripts: Sequence[ReplayScript]) -> Path:
    """Writes `scripts` as the JSONL file `ReplayEngine.from_file` reads."""
    Path(path).write_text("".join(json.dumps(s.to_json()) + "\n" for s in scripts))
    return Path(path)


def read_scripts(path: Path) -> list[ReplayScript]:
    scripts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            scripts.append(ReplayScript(record["key"],
                                        tuple(tuple(turn) for turn in record["turns"])))
    return scripts


class ReplayEngine(ScriptedEngine):
    """Replies with the turn of the session's script (see the module docstring); a
    prompt that matches no script, or asks past its last turn, gets `default`.
    `decode` turns prompt IDs into text with special tokens kept."""

    def __init__(self, scripts: Sequence[ReplayScript], decode: Callable[[list[int]], str],
                 default: list[int], stop_token_ids: tuple[int, ...]):
        super().__init__(default=list(default), stop_token_ids=stop_token_ids)
        self.replay_scripts, self.decode = list(scripts), decode
        self.num_unmatched = 0

    @classmethod
    def from_file(cls, path: Path, model_dir: Path, default_text: str = "No script left."
                  ) -> ReplayEngine:
        """The engine for the scripts in `path`, decoding with `model_dir`'s tokenizer."""
        from undertow.gateway.render import Renderer

        renderer = Renderer(model_dir)
        stop_ids = tuple(sorted(renderer.stop_token_ids))
        return cls(read_scripts(path),
                   lambda ids: renderer.decode(ids, skip_special_tokens=False),
                   renderer.encode(default_text) + [stop_ids[0]], stop_ids)

    def next_script(self, input_ids: list[int]) -> list[int]:
        prompt = self.decode(input_ids)
        num_turns = prompt.count(ASSISTANT_HEADER) - 1  # the last one is being generated
        for script in self.replay_scripts:
            if script.key in prompt and 0 <= num_turns < len(script.turns):
                return list(script.turns[num_turns])
        self.num_unmatched += 1
        return list(self.default)


@contextlib.asynccontextmanager
async def serve_engine(engine: ScriptedEngine, host: str = "127.0.0.1"
                       ) -> AsyncIterator[str]:
    """Serves `engine` on a free port of `host`; yields its base URL."""
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, 0).start()
        yield f"http://{host}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
