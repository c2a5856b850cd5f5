"""The replay engine: each prompt gets the turn of the script whose key it holds, chosen
by how many assistant turns the prompt already has, whatever order sessions come in."""

import aiohttp

from undertow.gateway.engines.scripted import (
    ReplayEngine,
    ReplayScript,
    read_scripts,
    serve_engine,
    write_scripts,
)
from undertow.gateway.render import Renderer

SCRIPTS = [ReplayScript("Fix the parser.", ((11, 12), (13,))),
           ReplayScript("Fix the sorter.", ((21,), (22, 23, 24)))]


def _prompt(renderer: Renderer, task: str, num_turns: int) -> list[int]:
    text = f"<|im_start|>user\n{task}<|im_end|>\n"
    text += "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nout<|im_end|>\n" * num_turns
    return renderer.encode(text + "<|im_start|>assistant\n")


async def test_replies_follow_each_sessions_script(tiny_model_dir, tmp_path):
    renderer = Renderer(tiny_model_dir)
    path = write_scripts(tmp_path / "scripts.jsonl", SCRIPTS)
    assert read_scripts(path) == SCRIPTS
    engine = ReplayEngine.from_file(path, tiny_model_dir)
    asks = [("Fix the sorter.", 1), ("Fix the parser.", 0), ("Fix the sorter.", 0),
            ("Fix the parser.", 1), ("Something else.", 0), ("Fix the parser.", 2)]
    replies = []
    async with serve_engine(engine) as url, aiohttp.ClientSession() as http:
        for task, num_turns in asks:
            body = {"input_ids": _prompt(renderer, task, num_turns),
                    "sampling_params": {"max_new_tokens": 16}}
            async with http.post(url + "/generate", json=body) as reply:
                replies.append((await reply.json())["output_ids"])
    assert replies[:4] == [[22, 23, 24], [11, 12], [21], [13]]
    assert replies[4] == replies[5] == engine.default
    assert engine.num_unmatched == 2


async def test_max_new_tokens_cuts_a_turn(tiny_model_dir, tmp_path):
    renderer = Renderer(tiny_model_dir)
    engine = ReplayEngine.from_file(write_scripts(tmp_path / "s.jsonl", SCRIPTS),
                                    tiny_model_dir)
    body = {"input_ids": _prompt(renderer, "Fix the sorter.", 1),
            "sampling_params": {"max_new_tokens": 2}}
    async with (serve_engine(engine) as url, aiohttp.ClientSession() as http,
                http.post(url + "/generate", json=body) as reply):
        result = await reply.json()
    assert result["output_ids"] == [22, 23]
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
