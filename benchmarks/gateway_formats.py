"""Part (d) of the gateway benchmark: the latency a reasoning template and a tool-call
format other than Hermes add, against the default template and Hermes.

For each case a gateway (`undertow gateway serve`, `tool_parser=auto`) runs in front of a
scripted engine (served in this process) that streams one completion token by token: a
reasoning block and a tool call in the case's format (about 80 tokens). The cases:

- `default template, hermes`: the tiny model's template, `<think>` and a Hermes
  `<tool_call>{json}</tool_call>` in the completion;
- `thinking template, qwen3_coder`: the thinking template of the reasoning tests (the
  generation prompt opens the think block, tool calls in Qwen3-Coder's XML, so `auto`
  picks `qwen3_coder`), the completion continuing the reasoning then an XML call;
- `Qwen2.5-Coder template, hermes`: a real model's tokenizer (151,665 tokens) and chat
  template, Qwen2.5-Coder-0.5B-Instruct's as `make setup-models` fetches it into
  `.cache/models` (the case is left out, and says so, where it has not been fetched); the
  completion a sentence and a Hermes call, ended by the model's own `<|im_end|>`.

Each proxied call (a new session, the tools in the request, so the prompt is rendered in
full and the completion parsed) is paired with a direct streamed `/generate` of the same
prompt IDs to the same engine, as in part (a); added = proxied - direct. The difference of
the two cases' added p50 is what the reasoning template and the XML parser cost.
"""

import contextlib
from pathlib import Path

import aiohttp

from benchmarks.proxies import TIMEOUT, open_session, post, post_read, start_gateway, stop
from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.thinking_template import thinking_model_dir
from undertow.gateway.engines.scripted import serve_engine
from undertow.gateway.render import Renderer

REASONING = ("The failing test imports the parser module; I should list the package first, "
             "then read the module that defines the parser and its tests.")
TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"},
                                         "timeout": {"type": "integer"}}}}}
HERMES = (f"<think>\n{REASONING}\n</think>\n\nListing the package.\n<tool_call>\n"
          '{"name": "bash", "arguments": {"cmd": "ls -la undertow/gateway", "timeout": 30}}'
          "\n</tool_call>")
QWEN3_CODER = (f"{REASONING}\n</think>\n\nListing the package.\n<tool_call>\n<function=bash>\n"
               "<parameter=cmd>\nls -la undertow/gateway\n</parameter>\n<parameter=timeout>\n"
               "30\n</parameter>\n</function>\n</tool_call>")
QWEN_REPLY = ("Listing the package.\n<tool_call>\n"
              '{"name": "bash", "arguments": {"cmd": "ls -la undertow/gateway", "timeout": 30}}'
              "\n</tool_call>")
DEFAULT, THINKING = "default template, hermes", "thinking template, qwen3_coder"
QWEN = "Qwen2.5-Coder template, hermes"
QWEN_DIR = Path(__file__).resolve().parents[1] / ".cache" / "models" / "qwen2.5-coder-0.5b-instruct"


async def format_latency(model_dir: Path, work_dir: Path, num_calls: int, run_pairs) -> dict:
    """Part (d): paired added latency of each case (see the module docstring);
    `run_pairs` is part (a)'s pairing loop."""
    thinking_dir = thinking_model_dir(model_dir, work_dir / "thinking")
    cases = {DEFAULT: (model_dir, HERMES), THINKING: (thinking_dir, QWEN3_CODER)}
    if (QWEN_DIR / "tokenizer.json").is_file():
        cases[QWEN] = (QWEN_DIR, QWEN_REPLY)
    else:
        print(f"(d) {QWEN}: left out, {QWEN_DIR} not fetched (make setup-models)", flush=True)
    pairs, pids, gateways = {}, {}, []
    messages = [{"role": "user", "content": "The parser test fails; find out why."}]
    try:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(aiohttp.ClientSession(timeout=TIMEOUT))
            for name, (case_dir, completion) in cases.items():
                renderer = Renderer(case_dir)
                end = min(renderer.stop_token_ids)
                engine = ScriptedEngine(default=renderer.encode(completion) + [end],
                                        stop_token_ids=(end,))
                engine_url = await stack.enter_async_context(serve_engine(engine))
                process, url = await start_gateway(engine_url, case_dir,
                                                   work_dir / f"store-d-{len(gateways)}")
                gateways.append(process)
                pids[name] = process.pid
                prompt_ids = renderer.encode(renderer.render(messages, [TOOL],
                                                             add_generation_prompt=True))
                direct = {"input_ids": prompt_ids, "return_logprob": True, "stream": True,
                          "sampling_params": {"max_new_tokens": 256, "temperature": 0.0}}
                chat = {"model": "tiny", "messages": messages, "tools": [TOOL],
                        "max_tokens": 256, "temperature": 0.0}
                sessions = [await open_session(http, url, "formats")
                            for _ in range(num_calls + 10)]
                check = await post(http, sessions[-1]["base_url"] + "/chat/completions", chat,
                                   {"Authorization": f"Bearer {sessions[-1]['api_key']}"})
                if not check["choices"][0]["message"].get("tool_calls"):
                    raise RuntimeError(f"{name}: the gateway parsed no tool call: {check}")
                pairs[name] = (
                    lambda i, url=engine_url, body=direct: post_read(http, url + "/generate",
                                                                    body),
                    lambda i, sessions=sessions, body=chat: post(
                        http, sessions[i]["base_url"] + "/chat/completions", body,
                        {"Authorization": f"Bearer {sessions[i]['api_key']}"}))
            result = await run_pairs(pairs, pids, num_calls)
    finally:
        for process in gateways:
            await stop(process)
    result["reasoning_and_xml_parser_extra_p50_ms"] = (
        result[THINKING]["added_p50_ms"] - result[DEFAULT]["added_p50_ms"])
    return result


def formats_markdown(result: dict) -> list[str]:
    lines = ["", "| case (engine streams ~80 tokens) | direct p50 ms | proxied p50 ms | "
             "added p50 / p99 ms (paired) | gateway CPU ms/call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {row['direct']['p50_ms']:.2f} | {row['proxied']['p50_ms']:.2f} | "
              f"{row['added_p50_ms']:.2f} / {row['added_p99_ms']:.2f} | "
              f"{row['cpu_ms_per_call_p50']:.2f} |"
              for name, row in result.items() if isinstance(row, dict)]
    lines += ["", "Reasoning template + Qwen3-Coder parser, added p50 over default + Hermes: "
              f"{result['reasoning_and_xml_parser_extra_p50_ms']:+.2f} ms."]
    return lines
