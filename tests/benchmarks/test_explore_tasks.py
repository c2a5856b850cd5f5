"""The task family that needs exploration (`benchmarks/explore_tasks.py`): what a
statement hides, the decoy, the held-out repository, determinism, and (Docker) that
generated tasks pass `undertow tasks validate`; what the agent did, read from a tree
store (`benchmarks/explore_behaviour.py`); `benchmarks/learning.py --family explore`."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.explore_behaviour import behaviour_of, command_kind, session_commands
from benchmarks.explore_tasks import (
    ORACLE_FILE,
    REPOS,
    TRAIN_REPOS,
    UNSEEN_REPO,
    draw_splits,
    generate,
    problem_statement,
)
from benchmarks.learning import EXPLORE_CONFIG, parse_args, scaffold_options, train_argv
from undertow.cli import main
from undertow.gateway.trees.group_log import encode_event
from undertow.gateway.trees.tree import Tree
from undertow.sandboxes.task import load_tasks

QWEN = Path(__file__).resolve().parents[2] / ".cache" / "models" / "qwen2.5-coder-0.5b-instruct"


def _files(folder):
    return {path.relative_to(folder): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _call(repo_dir, repo, chain):
    """The public call's result, computed by running the repository's code."""
    root = repo_dir / (repo.root or ".")
    code = f"from {repo.public} import {chain.entry}; print({chain.entry}({chain.arg}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def test_repositories_are_large_and_the_held_out_one_shares_no_name_or_number():
    for repo in REPOS:
        assert len(repo.modules) >= 10
        assert len({c.leaf_module for c in repo.chains}) == len(repo.chains)
    unseen = next(repo for repo in REPOS if repo.package == UNSEEN_REPO)
    trained = [repo for repo in REPOS if repo.package in TRAIN_REPOS]

    def names(repo):
        parts = {part for module in repo.modules for part in module.split(".")}
        chains = {name for c in repo.chains
                  for name in (c.entry, c.helper, c.leaf, c.constant)}
        return parts | chains | {repo.package, repo.convert, repo.labeller}

    assert not names(unseen) & set().union(*(names(repo) for repo in trained))
    assert all(repo.high < unseen.low for repo in trained)
    assert unseen.root and not any(repo.root for repo in trained)


def test_statements_hide_the_fix_and_a_decoy_holds_the_wrong_number():
    splits = draw_splits(48, 16, seed=4, heldout_fraction=0.25)
    assert {i.repo.package for i in splits["heldout"]} == {UNSEEN_REPO}
    assert {i.repo.package for i in splits["train"]} == set(TRAIN_REPOS)
    assert {i.repo.package for i in splits["heldout-seen"]} <= set(TRAIN_REPOS)
    for instance in [*splits["train"], *splits["heldout"], *splits["heldout-seen"]]:
        repo, chain = instance.repo, instance.repo.chains[instance.chain]
        hidden = {chain.helper, chain.leaf, chain.constant, repo.path(chain.leaf_module),
                  *chain.leaf_module.split("."), *chain.helper_module.split(".")}
        for difficulty in ("call", "numbers", "constant"):
            statement = problem_statement(instance, difficulty)
            named = {chain.constant} if difficulty == "constant" else set()
            found = {name for name in hidden if re.search(rf"\b{re.escape(name)}\b", statement)}
            assert found == named, (statement, found)
            assert chain.entry in statement
        decoy = repo.chains[instance.decoy]
        assert decoy.leaf_module != chain.leaf_module
        assert instance.values(fixed=False)[instance.decoy] == instance.wrong
        assert instance.values(fixed=True)[instance.decoy] == instance.wrong
        assert repo.low <= instance.right <= repo.high and instance.right != instance.wrong


def test_each_task_breaks_the_stated_call_and_its_patch_mends_it(tmp_path):
    folders = generate(tmp_path / "tasks", num_instances=6, num_unseen=4, seed=9)
    repos = {repo.package: repo for repo in REPOS}
    for folder in folders.values():
        for task in load_tasks(folder):
            repo = repos[task.repo.split("/")[1]]
            stated = re.search(r">>> (\w+)\((-?\d+)\)\n(-?\d+)\n.*I expected (-?\d+)\.",
                               task.problem_statement, re.S)
            assert stated is not None
            chain = next(c for c in repo.chains if c.entry == stated[1])
            repo_dir = tmp_path / "work" / task.instance_id
            assert task.source_dir is not None
            shutil.copytree(folder / task.source_dir, repo_dir)
            assert _call(repo_dir, repo, chain) == int(stated[4])  # the FIXED state
            subprocess.run(["git", "apply", "-R", "-"], input=task.patch, text=True,
                           cwd=repo_dir, check=True)
            assert _call(repo_dir, repo, chain) == int(stated[3])  # the base state
            changed = re.findall(r"^\+\+\+ b/(.+)$", task.patch, re.M)
            constants = [line for line in task.patch.splitlines() if line[:1] in "+-"
                         and not line.startswith(("+++", "---"))]
            assert len(changed) == 1 and len(constants) == 2
            wrong = re.findall(r"= (\d+)$", constants[0])[0]
            holders = [p for p in repo_dir.rglob("*.py")
                       if re.search(rf"^[A-Z_]+ = {wrong}$", p.read_text(), re.M)]
            assert len(holders) == 2 and changed[0] in {str(p.relative_to(repo_dir))
                                                        for p in holders}
            assert any(t.endswith(f"::test_{c.entry}") for t in task.PASS_TO_PASS
                       for c in repo.chains if c is not chain)


def test_a_splits_first_instances_span_every_training_repository():
    splits = draw_splits(num_instances=60, num_unseen=4, seed=0, heldout_fraction=0.25)
    for name in ("train", "heldout-seen"):
        repos = [instance.repo.package for instance in splits[name]]
        assert set(repos[:3]) == set(TRAIN_REPOS), (name, repos)
        # Each repository's instances keep their order.
        for repo in TRAIN_REPOS:
            numbers = [i.number for i in splits[name] if i.repo.package == repo]
            assert numbers == sorted(numbers)


def test_output_depends_only_on_the_seed(tmp_path):
    first = generate(tmp_path / "a", num_instances=6, num_unseen=2, seed=5)
    second = generate(tmp_path / "b", num_instances=6, num_unseen=2, seed=5)
    other = generate(tmp_path / "c", num_instances=6, num_unseen=2, seed=6)
    for name in first:
        assert _files(first[name]) == _files(second[name])
        assert _files(first[name]) != _files(other[name])
    with pytest.raises(ValueError, match="difficulty='easy'"):
        generate(tmp_path / "bad", num_instances=6, num_unseen=2, difficulty="easy")


@pytest.mark.docker
def test_a_training_and_a_held_out_task_pass_validation(tmp_path, capsys):
    folders = generate(tmp_path / "tasks", num_instances=6, num_unseen=1, seed=0)
    for name in ("train", "heldout"):
        task = load_tasks(folders[name])[0]
        argv = ["tasks", "validate", str(folders[name]), "--runs", "1", "--task",
                task.instance_id]
        assert main(argv) == 0
        assert "1/1 tasks valid" in capsys.readouterr().out


def test_command_kinds():
    assert command_kind("grep -rn berth_fee /testbed --include=*.py") == "search"
    assert command_kind("ls src/harbor") == "search"
    assert command_kind("cat src/harbor/yard/stack.py") == "read"
    assert command_kind("sed -n 1,20p src/harbor/port.py") == "read"
    assert command_kind("sed -i 's/114/139/' src/harbor/yard/stack.py") == "edit"
    assert command_kind("cd /testbed && sed -i.bak 's/1/2/' a.py") == "edit"
    assert command_kind("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT") == "submit"
    assert command_kind("python -m pytest") == "run"
    assert command_kind(None) == "none"


@pytest.mark.skipif(not QWEN.is_dir(), reason="needs `make setup-models` (Qwen2.5-Coder)")
def test_behaviour_is_read_from_the_tree_store(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    replies = {"s1": ["```bash\ngrep -rn berth_fee /testbed\n```",
                      "```bash\ncat src/harbor/yard/stack.py\n```",
                      "```bash\nsed -i 's/114/139/' src/harbor/yard/stack.py\n```"],
               "s2": ["```bash\nsed -i 's/114/139/' src/harbor/yard/scale.py\n```",
                      "I am not sure."]}
    tree, events, sampled = Tree("g0"), [], []
    for session_id, texts in replies.items():
        prompt = tokenizer.encode("Fix this issue: berth_fee gives a wrong result")
        for number, text in enumerate(texts):
            completion = tokenizer.encode(text)
            logprobs = [-0.1 * (1 + i % 3) for i in range(len(completion))]
            sampled += logprobs
            record = tree.add_call(f"{session_id}-{number}", session_id, prompt, completion,
                                   logprobs, [0] * len(completion))
            events.append(record.to_json())
            prompt = [*prompt, *completion, *tokenizer.encode("<output>ok</output>")]
    store = tmp_path / "store"
    store.mkdir()
    (store / "g0.jsonl").write_bytes(b"".join(encode_event(e) for e in events))
    sessions = session_commands(store, tokenizer.decode)
    assert [c for c, _ in sessions["s1"]] == [
        "grep -rn berth_fee /testbed", "cat src/harbor/yard/stack.py",
        "sed -i 's/114/139/' src/harbor/yard/stack.py"]
    assert sessions["s2"][1][0] is None
    summary = {"sessions": [
        {"session_id": "s1", "instance_id": "harbor__issue-1", "resolved": True},
        {"session_id": "s2", "instance_id": "harbor__issue-1", "resolved": False}]}
    figures = behaviour_of(sessions, summary, {"harbor__issue-1": "src/harbor/yard/stack.py"})
    assert figures["calls_per_session"] == {2: 1, 3: 1}
    assert figures["calls_per_resolved_session_mean"] == 3
    assert figures["num_sessions_with_edit"] == 2
    assert figures["search_before_edit"] == 0.5 and figures["right_file_first_edit"] == 0.5
    assert figures["entropy_per_token"] == pytest.approx(-sum(sampled) / len(sampled))
    assert figures["command_kinds"] == {"search": 1, "read": 1, "edit": 2, "none": 1}


def test_sessions_that_send_their_last_command_again_are_counted():
    cat, grep = "cat src/harbor/yard/stack.py", "grep -rn 114 /testbed"
    sessions = {"loop": [(grep, [-0.1]), (cat, [-0.1]), (None, [-0.1]), (cat, [-0.1])],
                "twice": [(cat, [-0.1]), (grep, [-0.1]), (cat, [-0.1])]}
    summary = {"sessions": [{"session_id": s, "instance_id": "harbor__issue-1"}
                            for s in sessions]}
    figures = behaviour_of(sessions, summary, {"harbor__issue-1": "src/harbor/yard/stack.py"})
    assert figures["num_sessions_repeating"] == 1


def test_the_explore_family_runs_many_calls_and_chooses_how_cut_sessions_count(tmp_path):
    args = parse_args(["--family", "explore", "--cut-sessions", "tree_value"])
    assert scaffold_options(args) == {"step_limit": 8, "max_tokens": 96, "temperature": 1.0,
                                      "overrides": [str(EXPLORE_CONFIG)]}
    assert (args.difficulty, args.max_staleness, args.eval_seen_sessions) == ("numbers", 1, 64)
    assert args.results.name == "learning_explore.json"
    argv = train_argv(tmp_path, tmp_path / "model", args, 4)
    assert "advantages.timeout_reward=tree_value" in argv
    assert "learner.max_staleness=1" in argv
    assert f"rollout.tasks={tmp_path / 'tasks' / 'train'}" in argv
    swe = parse_args([])
    assert (swe.difficulty, swe.max_staleness, swe.eval_seen_sessions) == ("line", 0, 0)
    assert "advantages.timeout_reward=partial_credit" in train_argv(tmp_path, tmp_path, swe, 2)


def test_the_explore_configs_regex_takes_one_shell_block_as_mini_swe_agent_parses_it():
    from minisweagent.exceptions import FormatError
    from minisweagent.models.utils.actions_text import parse_regex_actions

    config = yaml.safe_load(EXPLORE_CONFIG.read_text())
    assert "{{task}}" in config["agent"]["instance_template"]
    model = config["model"]

    def parse(reply):
        return parse_regex_actions(reply, action_regex=model["action_regex"],
                                   format_error_template=model["format_error_template"])

    command = "grep -rn berth_fee /testbed --include=*.py"
    assert parse(f"First find it:\n```bash\n{command}\n```") == [{"command": command}]
    with pytest.raises(FormatError):
        parse(f"```bash\n{command}\n```\n```bash\ncat x.py\n```")


def test_the_oracle_session_run_with_real_grep_and_sed_passes_the_tasks_tests(tmp_path):
    folders = generate(tmp_path / "tasks", num_instances=6, num_unseen=2, seed=3)
    for folder in (folders["train"], folders["heldout"]):
        oracle = {r["instance_id"]: r["commands"] for r in map(
            json.loads, (folder / ORACLE_FILE).read_text().splitlines())}
        for task in load_tasks(folder):
            repo_dir = tmp_path / "work" / task.instance_id
            assert task.source_dir is not None
            shutil.copytree(folder / task.source_dir, repo_dir)
            subprocess.run(["git", "apply", "-R", "-"], input=task.patch, text=True,
                           cwd=repo_dir, check=True)  # the base state, as the sandbox has it
            subprocess.run(["git", "apply", "-"], input=task.test_patch, text=True,
                           cwd=repo_dir, check=True)
            tests = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
            assert _pytest(repo_dir, tests).returncode != 0
            commands = oracle[task.instance_id]
            assert commands[-1] == "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
            outputs = [subprocess.run(command.replace("/testbed", str(repo_dir)), shell=True,
                                      capture_output=True, text=True, check=True).stdout
                       for command in commands]
            changed = re.findall(r"^\+\+\+ b/(.+)$", task.patch, re.M)[0]
            assert changed in outputs[0] and changed.removesuffix(".py").replace(
                "/", ".").removeprefix("src.") in outputs[2]  # grep and the helper show it
            assert _pytest(repo_dir, tests).returncode == 0, outputs


def _pytest(repo_dir, tests):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *tests], cwd=repo_dir, capture_output=True, text=True)
