"""`undertow sft-collect`'s oracle scripts: the gold patch's tool calls, or (`--commands`)
given shell commands as text actions, one ```bash block a reply."""

import json
from types import SimpleNamespace

import pytest

from undertow.gateway.render import Renderer
from undertow.sft_collect import oracle_scripts, read_commands


def _task(instance_id):
    return SimpleNamespace(instance_id=instance_id, problem_statement=f"bug in {instance_id}",
                           patch="diff --git a/x b/x\n")


def test_commands_become_one_bash_block_a_turn_each_ending_with_a_stop_token(
        tiny_model_dir, tmp_path):
    path = tmp_path / "oracle.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"instance_id": "a", "commands": ["grep -rn 5 /testbed", "echo DONE"]},
        {"instance_id": "b", "commands": ["cat /testbed/x.py"]})))
    commands = read_commands(path)
    [script] = oracle_scripts([_task("a")], tiny_model_dir, commands)
    renderer = Renderer(tiny_model_dir)
    stop_id = min(renderer.stop_token_ids)
    assert script.key == "bug in a"
    assert [turn[-1] for turn in script.turns] == [stop_id, stop_id]
    assert [renderer.decode(list(turn[:-1])) for turn in script.turns] == [
        "```bash\ngrep -rn 5 /testbed\n```", "```bash\necho DONE\n```"]
    [patch_script] = oracle_scripts([_task("a")], tiny_model_dir)
    assert "<tool_call>" in renderer.decode(list(patch_script.turns[0]))
    with pytest.raises(ValueError, match=r"no oracle commands for \['c'\]"):
        oracle_scripts([_task("c")], tiny_model_dir, commands)
