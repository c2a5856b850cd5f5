"""`python -m benchmarks.learning`: its held-out figures (the stages run `undertow` itself)."""

import json

import pytest
import yaml

from benchmarks.learning import (
    AGENT_CONFIG,
    EXPLORE_CONFIG,
    _summaries,
    _timed,
    collect_argv,
    eval_argv,
    eval_steps,
    evaluate,
    gain,
    group_rewards,
    parse_args,
    plot_heldout,
    point_model,
    prepare,
    scaffold_options,
    sft_argv,
    table,
    train_argv,
)


def _evaluation(step: int, num_resolved: int, interval: tuple[float, float]) -> dict:
    return {"model": f"sft+rl{step}", "rl_step": step, "num_sessions": 50,
            "num_resolved": num_resolved, "pass_rate": num_resolved / 50, "interval": interval,
            "session_s_mean": 12.5, "rollout_s": 300.0}


def test_table_and_plot_show_each_point_with_its_interval(tmp_path):
    evals = [_evaluation(0, 5, (0.043, 0.214)), _evaluation(2, 11, (0.128, 0.352))]
    lines = table(evals).splitlines()
    assert lines[2] == "| sft+rl0 | 0 | 50 | 5 | 10.0% | 4.3%-21.4% | 12.5 | 300 |"
    assert lines[3].startswith("| sft+rl2 | 2 | 50 | 11 | 22.0% | 12.8%-35.2% |")
    steps = [{"step": 1, "mismatch_mean": 0.01, "mismatch_max": 0.4},
             {"step": 2, "mismatch_mean": None, "mismatch_max": None}]
    path = plot_heldout(evals, steps, tmp_path / "heldout.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seen = [_evaluation(0, 8, (0.1, 0.3)), _evaluation(2, 16, (0.3, 0.5))]
    both = plot_heldout(evals, steps, tmp_path / "both.png", seen)
    assert both.read_bytes() != path.read_bytes()


def test_gain_is_the_last_point_against_the_first_with_newcombes_interval():
    first, last = _evaluation(0, 5, (0.043, 0.214)), _evaluation(30, 20, (0.26, 0.54))
    result = gain([first, _evaluation(10, 9, (0.1, 0.3)), last])
    assert result is not None
    assert (result["from_step"], result["to_step"]) == (0, 30)
    assert result["difference"] == pytest.approx(0.3)
    low, high = result["interval"]
    assert 0.13 < low < 0.3 < high < 0.45 and result["excludes_zero"]
    assert not (gain([first, _evaluation(30, 8, (0.08, 0.29))]) or {})["excludes_zero"]
    assert gain([first]) is None


def test_group_rewards_count_groups_with_variance_and_skip_infra_failures(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    for group, rewards in (("g0", [1.0, 0.0]), ("g1", [0.0, 0.0]), ("g2", [1.0, 0.0])):
        events = [{"kind": "session_close", "session_id": f"{group}-s{index}", "reward": reward,
                   "meta": {"infra_failure": group == "g2" and reward == 0.0}}
                  for index, reward in enumerate(rewards)]
        (store / f"{group}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    groups = group_rewards(store)
    assert groups["rewards"] == {"g0": [1.0, 0.0], "g1": [0.0, 0.0], "g2": [1.0]}
    assert (groups["num_groups"], groups["num_with_variance"]) == (3, 1)


def test_defaults_give_at_least_150_held_out_sessions_a_point():
    args = parse_args([])
    assert args.eval_sessions >= 150 and args.num_steps % args.eval_every == 0
    assert eval_steps(parse_args(["--num-steps", "25", "--eval-every", "10"])) == [10, 20, 25]
    assert eval_steps(parse_args(["--num-steps", "0"])) == []


def test_a_pretrained_policy_gets_the_short_text_prompts_and_the_tiny_one_its_sft_format(
        tmp_path):
    pretrained = parse_args(["--model", "qwen2.5-coder-0.5b-instruct"])
    assert scaffold_options(pretrained) == {"step_limit": 1, "max_tokens": 96,
                                            "temperature": 1.0,
                                            "overrides": [str(AGENT_CONFIG)]}
    argv = train_argv(tmp_path, tmp_path / "model", pretrained, 20)
    assert f"run.model_dir={tmp_path / 'model'}" in argv and "learner.num_steps=20" in argv
    assert "learner.activation_checkpointing=true" in argv
    assert 'learner.frozen=["model.embed_tokens", "lm_head"]' in argv
    options = next(a for a in argv if a.startswith("rollout.scaffold_options="))
    assert json.loads(options.partition("=")[2])["overrides"] == [str(AGENT_CONFIG)]
    tiny = parse_args(["--model", "tiny", "--step-limit", "2"])
    assert scaffold_options(tiny) == {"step_limit": 2, "max_tokens": 256, "temperature": 1.0}
    assert not any(a.startswith("learner.frozen") for a in train_argv(tmp_path, tmp_path, tiny, 2))


def test_rl_sessions_may_get_a_shorter_time_limit_than_held_out_points(tmp_path):
    same = parse_args(["--family", "explore"])
    assert "rollout.timeout_s=600.0" in train_argv(tmp_path, tmp_path, same, 4)
    cut = parse_args(["--family", "explore", "--train-timeout-s", "200"])
    assert "rollout.timeout_s=200.0" in train_argv(tmp_path, tmp_path, cut, 4)
    assert cut.timeout_s == 600.0   # the held-out rollouts' limit


def test_the_agent_configs_regex_takes_one_shell_block_as_mini_swe_agent_parses_it():
    from minisweagent.exceptions import FormatError
    from minisweagent.models.utils.actions_text import parse_regex_actions

    model = yaml.safe_load(AGENT_CONFIG.read_text())["model"]
    assert model["model_class"] == "litellm_textbased"

    def parse(reply):
        return parse_regex_actions(reply, action_regex=model["action_regex"],
                                   format_error_template=model["format_error_template"])

    command = "sed -i 's/8/36/' shopcalc/discount.py"
    for fence in ("bash", "sh", "mswea_bash_command", ""):
        assert parse(f"Fix it:\n\n```{fence}\n{command}\n```\nDone.") == [{"command": command}]
    for reply in (f"```python\n{command}\n```", f"Run `{command}`.",
                  f"```bash\n{command}\n```\n```bash\ncat shopcalc/discount.py\n```"):
        with pytest.raises(FormatError):
            parse(reply)


def test_a_skipped_stage_keeps_the_command_and_timing_of_the_run_that_did_it(tmp_path):
    log, first, later = tmp_path / "stage.log", {}, {}
    _timed(first, "stage", ["--help"], log, done=False, module="json.tool")
    assert first["stage"]["command"] == "python -m json.tool --help"
    assert first["stage"]["wall_s"] > 0 and len(first["stage"]["load_average_1m"]) == 2
    _timed(later, "stage", ["--help", "--sort-keys"], log, done=True, module="json.tool")
    assert later == first
    _timed(later, "other", ["--help"], tmp_path / "other.log", done=True, module="json.tool")
    assert later["other"]["wall_s"] is None


def test_a_held_out_points_weights_outlive_the_runs_pruning_of_its_checkpoint(tmp_path):
    checkpoints = tmp_path / "train" / "checkpoints"
    for step in (4, 5):
        (checkpoints / f"step-{step:06d}" / "model").mkdir(parents=True)
        (checkpoints / f"step-{step:06d}" / "model" / "model.safetensors").write_text(str(step))
    kept = point_model(tmp_path, 4)
    # The run prunes step 4 (learner.keep_checkpoints); the point's weights stay.
    weights = checkpoints / "step-000004" / "model" / "model.safetensors"
    assert weights.stat().st_nlink == 2  # a hard link, not a copy
    for path in sorted(checkpoints.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    assert (kept / "model.safetensors").read_text() == "4"
    assert point_model(tmp_path, 4) == kept
    # A point pruned before it was kept has no weights; its path is still where they go.
    assert not point_model(tmp_path, 8).exists()


def test_a_held_out_point_smaller_than_its_split_takes_each_repository_in_turn(tmp_path):
    split = tmp_path / "heldout-seen"
    split.mkdir()
    # Sorted by repository, as explore_tasks wrote splits before it interleaved them.
    ids = [f"{repo}__issue-{i}" for repo in ("ledger", "orbit", "quill") for i in range(10)]
    (split / "tasks.jsonl").write_text("".join(
        json.dumps({"instance_id": i, "repo": i.split("__")[0]}) + "\n" for i in ids))
    args = parse_args(["--family", "explore"])
    argv = eval_argv(split, tmp_path / "out", tmp_path / "model", 7, args)
    picked = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--task"]
    assert picked == ["ledger__issue-0", "orbit__issue-0", "quill__issue-0",
                      "ledger__issue-1", "orbit__issue-1", "quill__issue-1", "ledger__issue-2"]
    assert "num_tasks=7" in argv and "group_size=1" in argv
    # A point of more sessions than instances runs each instance as often.
    argv = eval_argv(split, tmp_path / "out", tmp_path / "model", 75, args)
    assert "--task" not in argv and "num_tasks=30" in argv and "group_size=3" in argv


def test_held_out_sessions_the_policy_never_answered_are_left_out(tmp_path):
    (tmp_path / "tasks" / "heldout").mkdir(parents=True)
    (tmp_path / "tasks" / "heldout" / "tasks.jsonl").write_text("".join(
        json.dumps({"instance_id": f"t{i}", "repo": "acme/calc"}) + "\n" for i in range(75)))
    sessions = [{"instance_id": task, "cause": cause, "num_calls": calls, "resolved": resolved,
                 "duration_s": 10.0, "details": {}}
                for task, cause, calls, resolved in (
                    ("a", "exited", 1, True), ("a", "exited", 1, False),
                    ("b", "timeout", 0, False), ("b", "timeout", 1, False),
                    ("c", "error:sandbox", 0, False))]
    # Two rollouts make the point (a probe's 3 sessions, then the 2 it lacked), pooled;
    # with every session there, no rollout runs.
    for name, part in (("rollout-1", sessions[:3]), ("rollout-2", sessions[3:])):
        out = tmp_path / "eval" / "start" / name
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({
            "sessions": part, "duration_s": 10.0 * len(part), "num_completion_tokens": 30}))
    row = evaluate(tmp_path, "start", tmp_path / "model", parse_args(["--eval-sessions", "5"]))
    assert (row["num_sessions"], row["num_resolved"], row["num_left_out"]) == (3, 1, 2)
    assert row["num_timed_out_unanswered"] == 1 and row["pass_rate"] == pytest.approx(1 / 3)
    assert row["causes"] == {"exited": 2, "timeout": 2, "error:sandbox": 1}
    assert (row["num_rollouts"], row["rollout_s"], row["session_s_mean"]) == (2, 50.0, 10.0)


def test_an_sft_start_collects_gold_sessions_then_trains_with_a_small_lr_and_frozen_head(
        tmp_path):
    args = parse_args(["--family", "explore", "--start", "sft", "--work", str(tmp_path),
                       "--results", str(tmp_path / "probe.json")])
    assert (args.sft_lr, args.num_sft_tasks, args.plot) == (1e-5, 40, tmp_path / "probe.png")
    base, train = tmp_path / "base", tmp_path / "tasks" / "train"
    train.mkdir(parents=True)
    (train / "tasks.jsonl").write_text("".join(
        json.dumps({"repo": f"x/{repo}", "instance_id": f"{repo}-{i}"}) + "\n"
        for repo, num in (("ledger", 30), ("orbit", 20), ("quill", 2)) for i in range(num)))
    collect = collect_argv(tmp_path, base, args)
    assert collect[:3] == ["sft-collect", "--tasks", str(train)]
    chosen = [collect[i + 1] for i, a in enumerate(collect) if a == "--task"]
    assert chosen[:6] == ["ledger-0", "orbit-0", "quill-0", "ledger-1", "orbit-1", "quill-1"]
    assert [sum(c.startswith(repo) for c in set(chosen)) for repo in ("ledger", "orbit",
                                                                      "quill")] == [19, 19, 2]
    for flag, value in (("--commands", str(train / "oracle.jsonl")), ("--step-limit", "8"),
                        ("--max-tokens", "96"), ("--agent-config", str(EXPLORE_CONFIG))):
        assert collect[collect.index(flag) + 1] == value
    assert sft_argv(tmp_path, base, args)[-3:] == [
        "sft.lr=1e-05", "sft.min_reward=1", 'sft.frozen=["model.embed_tokens", "lm_head"]']
    tiny = parse_args(["--model", "tiny"])
    assert (tiny.sft_lr, tiny.num_sft_tasks) == (3e-3, 60)
    assert "--commands" not in collect_argv(tmp_path, base, tiny)
    assert collect_argv(tmp_path, base, tiny)[-2:] == ["--num-tasks", "60"]
    assert not any(a.startswith("sft.frozen") for a in sft_argv(tmp_path, base, tiny))
    with pytest.raises(SystemExit):
        parse_args(["--start", "sft"])  # the swe family has no gold session


def test_an_sft_start_skips_the_stages_whose_output_is_there(tmp_path):
    args = parse_args(["--family", "explore", "--start", "sft", "--work", str(tmp_path),
                       "--sft-epochs", "1"])
    for split in ("train", "heldout", "heldout-seen"):
        (tmp_path / "tasks" / split).mkdir(parents=True)
        (tmp_path / "tasks" / split / "tasks.jsonl").write_text(
            '{"repo": "x/ledger", "instance_id": "ledger-1"}\n')
    (tmp_path / "oracle-store").mkdir()
    (tmp_path / "oracle-store" / "g0.jsonl").write_text("")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"")
    (tmp_path / "sft" / "metrics.jsonl").write_text(
        '{"loss": 2.0, "train_s": 1.0}\n{"loss": 1.0, "train_s": 3.0}\n')
    record: dict = {}
    assert prepare(tmp_path, args, record) == ("sft", tmp_path / "sft")
    assert record["sft"]["command"].startswith("python -m undertow.cli sft --store")
    assert (record["sft"]["num_steps"], record["sft"]["epoch_train_s"]) == (2, [4.0])
    assert record["collect"]["wall_s"] is None and record["collect"]["num_sessions"] == 0


def test_a_point_stopped_part_way_pools_only_the_sessions_that_ended(tmp_path):
    """A benchmark killed during a held-out rollout leaves a summary whose unrun sessions
    are pending or interrupted: they are neither failures nor passes, and the resumed
    point runs them again."""
    causes = ["exited", "timeout", "pending", "interrupted", "error: engine down"]
    (tmp_path / "rollout-1").mkdir()
    (tmp_path / "rollout-1" / "summary.json").write_text(json.dumps({"sessions": [
        {"instance_id": f"t{i}", "cause": cause, "resolved": False}
        for i, cause in enumerate(causes)]}))
    [summary] = _summaries(tmp_path)
    assert [s["cause"] for s in summary["sessions"]] == ["exited", "timeout",
                                                          "error: engine down"]
