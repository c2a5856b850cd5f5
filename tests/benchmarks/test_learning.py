"""`python -m benchmarks.learning`: its held-out figures (the stages run `undertow` itself)."""

import json

from benchmarks.learning import group_rewards, parse_args, plot_heldout, table


def _evaluation(step: int, num_resolved: int, interval: tuple[float, float]) -> dict:
    return {"model": f"sft+rl{step}", "rl_step": step, "num_sessions": 50,
            "num_resolved": num_resolved, "pass_rate": num_resolved / 50, "interval": interval,
            "session_s_mean": 12.5, "rollout_s": 300.0}


def test_table_and_plot_show_each_point_with_its_interval(tmp_path):
    evals = [_evaluation(0, 5, (0.043, 0.214)), _evaluation(2, 11, (0.128, 0.352))]
    lines = table(evals).splitlines()
    assert lines[2] == "| sft+rl0 | 0 | 50 | 5 | 10.0% | 4.3%-21.4% | 12.5 | 300 |"
    assert lines[3].startswith("| sft+rl2 | 2 | 50 | 11 | 22.0% | 12.8%-35.2% |")
    path = plot_heldout(evals, tmp_path / "heldout.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_defaults_give_at_least_50_held_out_sessions_a_point():
    args = parse_args([])
    assert args.eval_sessions >= 50 and args.num_steps % args.eval_every == 0
