"""The rollout side of the cells (`undertow/cells/pool.py`) against the real gateway and real
built-in engine processes: moving a cell to training drains its engine while a session
streams, the session continues on the other cell's engine (one reply, its tree exact),
and the engine process is gone; moving it back serves the newest weights. SGLang cells
go through the SGLang launcher end to end, with a stand-in for SGLang itself
(`sglang_standin.py`: SGLang's command line in, the built-in engine out): the wiring,
not SGLang."""

import json
import os
import re
import sys
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.builtin_engine.wire import prompt
from tests.gateway.capture import calls_of, captured
from undertow.cells.backends import LocalBackend
from undertow.cells.config import CellPoolConfig
from undertow.cells.pool import GatewayEngineSlots, engineless_gateway
from undertow.learner.gateway_link import GatewayLink
from undertow.run.rollout_source import background_loop

pytestmark = pytest.mark.slow

NUM_TOKENS = 200


@pytest.fixture
def cells(tiny_model_dir, tmp_path):
    with background_loop() as loop, \
            engineless_gateway(loop, tiny_model_dir, tmp_path / "store") as gateway:
        admin = GatewayLink(gateway.url, gateway.admin_token)
        slots = GatewayEngineSlots(loop, admin, tiny_model_dir, tmp_path / "engines")
        try:
            slots.start_all([0, 1])
            yield slots, admin
        finally:
            slots.close()


def _complete(admin, group, input_ids, on_piece=lambda pieces: None):
    opened = admin.request("POST", "/admin/sessions", {"group": group})
    client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
    pieces, finish_reasons = [], []
    try:
        stream = client.completions.create(model="m", prompt=input_ids, stream=True,
                                           max_tokens=NUM_TOKENS, temperature=0.0)
        for chunk in stream:
            pieces += [choice.text for choice in chunk.choices]
            finish_reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            on_piece(pieces)
    finally:
        client.close()
    return opened["session_id"], "".join(pieces), finish_reasons


def _resumes(admin, cause):
    with urllib.request.urlopen(admin.url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    match = re.search(rf'undertow_resumes_total{{cause="{cause}"}} (\S+)', text)
    return float(match[1]) if match else 0.0


def test_drained_cells_session_continues_on_the_other_engine(cells):
    slots, admin = cells
    input_ids = prompt(11, 300)
    reference_id, expected_text, _ = _complete(admin, "reference", input_ids)
    reference = admin.group_tree("reference")
    (reference_call,) = [captured(reference, c) for c in calls_of(reference, reference_id)]
    drained: list[int] = []
    drainer: list[threading.Thread] = []

    def drain_when_streaming(pieces):
        if len(pieces) == 5 and not drainer:
            (busy,) = [e["id"] for e in admin.engines() if e["num_in_flight"] == 1]
            drained.append(slots.cell_of(busy))
            drainer.append(threading.Thread(target=slots.drain, args=(drained[0],)))
            drainer[0].start()

    engines_before = {cell: engine for cell, (engine, _id) in slots.engines.items()}
    session_id, text, finish_reasons = _complete(admin, "moved", input_ids,
                                                 drain_when_streaming)
    drainer[0].join(timeout=120)
    assert not drainer[0].is_alive()

    assert finish_reasons == ["length"]  # one reply, finished once
    assert text == expected_text
    tree = admin.group_tree("moved")
    (call,) = [captured(tree, c) for c in calls_of(tree, session_id)]
    assert call.prompt_ids == input_ids
    assert call.completion_ids == reference_call.completion_ids
    assert len(call.completion_ids) == NUM_TOKENS
    assert call.weight_versions == [0] * NUM_TOKENS
    assert _resumes(admin, "migrate") == 1
    (cell,) = drained
    assert cell not in slots.engines
    assert engines_before[cell].process.poll() is not None  # its memory is released
    assert [e["url"] for e in admin.engines()] == [slots.engines[1 - cell][0].url]


def test_a_cell_back_from_training_serves_the_newest_weights(cells, tiny_model_dir):
    slots, admin = cells
    slots.push(tiny_model_dir, 1)
    assert {e["weight_version"] for e in admin.engines()} == {"1"}
    slots.drain(0)
    slots.drain(1)
    assert admin.engines() == []
    slots.push(tiny_model_dir, 2)  # no engine serves: the gateway's pool keeps version 1
    slots.serve(1, 2)
    slots.serve(0, 2)
    assert sorted(e["weight_version"] for e in admin.engines()) == ["2", "2"]
    assert sorted(slots.engines) == [0, 1]
    with pytest.raises(ValueError, match="newest pushed are 2"):
        slots.serve(0, 1)


def _standin_python(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that SGLangLauncher runs as its python, and the file it records to."""
    record = tmp_path / "sglang-launches.jsonl"
    script = tmp_path / "sglang-python"
    standin = Path(__file__).with_name("sglang_standin.py")
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{standin}" "{record}" "$@"\n')
    script.chmod(0o755)
    return script, record


def _launches(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_sglang_cells_start_on_their_gpus_take_weights_and_free_them(tiny_model_dir, tmp_path):
    python, record = _standin_python(tmp_path)
    pool = CellPoolConfig(engine="sglang", num_cells=2, tp_size=2, processes_per_cell=2,
                          mem_fraction_static=0.6, sglang_python=str(python))
    with background_loop() as loop, \
            engineless_gateway(loop, tiny_model_dir, tmp_path / "store") as gateway:
        admin = GatewayLink(gateway.url, gateway.admin_token)
        slots = LocalBackend(pool).engine_slots(loop, admin, tiny_model_dir,
                                                tmp_path / "engines", 1, "drain")
        try:
            slots.start_all([0, 1])
            launches = _launches(record)
            assert sorted(x["cuda_visible_devices"] for x in launches) == ["0,1", "2,3"]
            assert {(x["tp_size"], x["mem_fraction_static"], x["weight_version"],
                     x["enable_deterministic_inference"]) for x in launches} == \
                {(2, 0.6, "0", True)}
            assert {e["url"] for e in admin.engines()} == \
                {engine.url for engine, _id in slots.engines.values()}
            _session, text, finish_reasons = _complete(admin, "g", prompt(3, 20))
            assert finish_reasons == ["length"] and text

            slots.push(tiny_model_dir, 1)  # update_weights_from_disk on each engine
            assert [e["weight_version"] for e in admin.engines()] == ["1", "1"]
            engine, _id = slots.engines[0]
            slots.drain(0)
            assert engine.process.poll() is not None
            (standin_pid,) = [x["pid"] for x in launches if x["cuda_visible_devices"] == "0,1"]
            assert standin_pid == engine.process.pid  # the stand-in became the engine
            assert not os.path.exists(f"/proc/{standin_pid}")
            assert len(admin.engines()) == 1

            slots.prepare([0])  # the cell's GPUs are its member's until serve: no start
            assert (slots.warm, len(_launches(record))) == ({}, 2)
            slots.serve(0, 1)
            last = _launches(record)[-1]
            assert (last["cuda_visible_devices"], last["weight_version"]) == ("0,1", "1")
            assert sorted(e["weight_version"] for e in admin.engines()) == ["1", "1"]
        finally:
            slots.close()
