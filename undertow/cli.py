"""The `undertow` command line.

Each command group has its own `_add_<group>` function that declares its
arguments, and a handler that imports the part it needs only when it runs, so
that `undertow --help` stays fast and never imports torch. Environment
variables are read here and nowhere else.
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

# Command groups in `undertow/commands/`, one module each (see its docstring).
COMMAND_MODULES: tuple[str, ...] = ("engine", "gateway", "rollout", "doctor", "serve",
                                    "session", "trees_repair", "ui", "tasks_import", "export",
                                    "eval", "chat_eval", "model_check", "model_fetch")


def _add_model(commands) -> None:
    model = commands.add_parser("model", help="build model directories").add_subparsers(
        dest="action", required=True)
    init = model.add_parser("init", help="write a Hugging Face model directory, offline")
    init.add_argument("--out", type=Path, required=True, help="directory to write")
    init.add_argument("--size", choices=("tiny", "small", "qwen3-0.6b", "tiny-untied",
                                                 "qwen2.5-7b"), default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(handler=_model_init)


def _model_init(args) -> int:
    from undertow.learner.modeldir import init_model_dir

    path = init_model_dir(args.out, size=args.size, seed=args.seed)
    print(path)
    return 0


def _add_sandbox(commands) -> None:
    sandbox = commands.add_parser("sandbox", help="Docker sandboxes").add_subparsers(
        dest="action", required=True)
    base = sandbox.add_parser("build-base", help="build the base image offline (Debian packages)")
    base.add_argument("--mirror", default=None, help="Debian mirror (default: the host apt's)")
    base.add_argument("--cache-dir", type=Path, default=None,
                      help="where the root file system tarball is cached")
    base.set_defaults(handler=_sandbox_build_base)
    gc = sandbox.add_parser("gc", help="remove sandbox containers left by crashed runs")
    gc.add_argument("--run", default=None, help="only this run's containers (default: all)")
    gc.add_argument("--orphans-only", action="store_true",
                    help="keep containers whose starting process is still alive")
    gc.add_argument("--docker-host", action="append", default=[], metavar="URL",
                    help="a Docker daemon to clear (repeat for each of a run's "
                         "sandbox.docker_hosts; default: DOCKER_HOST or the local socket)")
    gc.set_defaults(handler=_sandbox_gc)


def _sandbox_build_base(args) -> int:
    from undertow.sandboxes import commands

    return commands.build_base(os.environ.get("DOCKER_HOST"), args.mirror, args.cache_dir)


def _sandbox_gc(args) -> int:
    from undertow.sandboxes import commands

    urls = args.docker_host or [os.environ.get("DOCKER_HOST")]
    return commands.collect_garbage(urls, args.run, args.orphans_only)


def _add_tasks(commands) -> None:
    tasks = commands.add_parser("tasks", help="SWE task sets").add_subparsers(
        dest="action", required=True)
    validate = tasks.add_parser("validate", help="check that each task's tests decide its fix")
    validate.add_argument("dir", type=Path, help="folder holding tasks.jsonl (or a dataset)")
    validate.add_argument("--runs", type=int, default=3, help="runs per task, to catch flakes")
    validate.add_argument("--concurrency", type=int, default=2)
    validate.add_argument("--task", action="append", default=None, help="only this instance_id")
    validate.set_defaults(handler=_tasks_validate)
    stamp = tasks.add_parser("stamp", help="compute and write base_commit of a shipped task set")
    stamp.add_argument("dir", type=Path, help="folder holding tasks.jsonl and repos/")
    stamp.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    stamp.set_defaults(handler=_tasks_stamp)


def _tasks_validate(args) -> int:
    from undertow.sandboxes import commands

    return commands.validate(os.environ.get("DOCKER_HOST"), args.dir, args.runs,
                             args.concurrency, args.task)


def _tasks_stamp(args) -> int:
    from undertow.sandboxes import commands

    return commands.stamp(args.dir, args.check)


def _add_simulate(commands) -> None:
    simulate = commands.add_parser(
        "simulate", help="simulate a cell-pool policy on a workload (discrete events)")
    simulate.add_argument("--workload", required=True, help="workload YAML/JSON file, or a "
                          "preset: qwengyre_long_tail, short_tail")
    simulate.add_argument("--policy", required=True, help="colocate, split or elastic")
    simulate.add_argument("--cells", type=int, required=True, help="number of cells")
    simulate.add_argument("--steps", type=int, default=4, help="RL steps to simulate")
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--training-cells", type=int, default=None,
                          help="split only: cells that train (default: half)")
    simulate.add_argument("--max-staleness", type=int, default=None,
                          help="split and elastic: how many steps the rollout weights may "
                          "lag (0: synchronous; default: the policy's, as in `undertow "
                          "train`: 1 for split, 0 for elastic)")
    simulate.add_argument("--plot", type=Path, default=None, help="write the roles timeline PNG")
    simulate.set_defaults(handler=_simulate)


def _simulate(args) -> int:
    from undertow.learner.sim import format_table, load_workload, simulate
    from undertow.learner.sim.plot import plot_timeline

    spec = {"name": args.policy}
    if args.policy == "split":
        spec["num_training_cells"] = args.training_cells or max(1, args.cells // 2)
    if args.policy in ("split", "elastic") and args.max_staleness is not None:
        spec["max_staleness"] = args.max_staleness
    result = simulate(load_workload(args.workload), spec, num_cells=args.cells,
                      num_steps=args.steps, seed=args.seed)
    print(format_table([result]))
    if args.plot is not None:
        print(plot_timeline([result], args.plot))
    return 0


def _add_trees(commands) -> None:
    trees = commands.add_parser("trees", help="inspect a gateway's tree store").add_subparsers(
        dest="action", required=True)
    show = trees.add_parser("show", help="print trees: spans, branch points, trainable tokens")
    show.add_argument("store", type=Path, help="tree store directory")
    show.add_argument("--group", default=None)
    show.add_argument("--session", default=None)
    show.add_argument("--max-tokens", type=int, default=12,
                      help="tokens of each span to print at its start and end")
    show.set_defaults(handler=_trees_show)
    stats = trees.add_parser("stats", help="unique tokens vs a per-call log")
    stats.add_argument("store", type=Path, help="tree store directory")
    stats.set_defaults(handler=_trees_stats)


def _trees_show(args) -> int:
    from undertow.gateway.front.trees_cli import show

    print(show(args.store, group=args.group, session=args.session, max_tokens=args.max_tokens))
    return 0


def _trees_stats(args) -> int:
    from undertow.gateway.front.trees_cli import stats

    print(stats(args.store))
    return 0


def _add_train(commands) -> None:
    train = commands.add_parser(
        "train", help="run engines, gateway, rollouts and the learner (default: the tiny "
        "model, mini-swe-agent on the bundled tasks)")
    train.add_argument("-c", "--config", type=Path, default=None, help="run config (YAML)")
    train.add_argument("--run-dir", type=Path, default=None, help="sets run.run_dir")
    train.add_argument("--resume", action="store_true",
                       help="continue the latest checkpoint of run.run_dir")
    train.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                       help="config overrides, e.g. learner.num_steps=4")
    train.set_defaults(handler=_train)


def _train(args) -> int:
    import signal
    import threading

    from undertow.learner.checkpoint import CheckpointError
    from undertow.learner.errors import RunFailedError
    from undertow.run_sections import load_sections
    from undertow.train_run import train

    sections = load_sections(args.config, args.overrides, args.run_dir, args.resume)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    try:
        outcome = train(sections, args.resume, stop)
    except (RunFailedError, CheckpointError) as error:   # one clear line, not a traceback
        print(f"undertow train: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0 if outcome == "done" else 143


def _add_sft(commands) -> None:
    sft = commands.add_parser("sft", help="warm start: cross-entropy on stored trajectories")
    source = sft.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", type=Path, help="tree store of the trajectories")
    source.add_argument("--data", type=Path,
                        help="a folder written by `undertow export sft` (sft.jsonl or hf/)")
    sft.add_argument("--model", type=Path, required=True, help="model directory to start from")
    sft.add_argument("--out", type=Path, required=True, help="model directory to write")
    sft.add_argument("-c", "--config", type=Path, default=None, help="config with an sft section")
    sft.add_argument("overrides", nargs="*", metavar="sft.KEY=VALUE")
    sft.set_defaults(handler=_sft)


def _sft(args) -> int:
    from undertow.config import build_section, read_config
    from undertow.learner.config import SFTConfig
    from undertow.learner.sft import run_sft
    from undertow.learner.trees import load_store_trees

    config = build_section(SFTConfig, read_config(args.config, args.overrides).get("sft"), "sft")
    if args.data is not None:
        from undertow.exports import read_sft_trees

        trees = read_sft_trees(args.data)
    else:
        trees = load_store_trees(args.store)
    print(run_sft(trees, args.model, args.out, config))
    return 0


def _add_sft_collect(commands) -> None:
    collect = commands.add_parser(
        "sft-collect", help="oracle trajectories of tasks (gold patches) through the real "
        "mini-swe-agent and gateway, into a tree store for `undertow sft`")
    collect.add_argument("--tasks", type=Path, required=True,
                         help="tasks.jsonl, a folder holding one, or a local dataset")
    collect.add_argument("--out", type=Path, required=True, help="tree store to write")
    collect.add_argument("--model", type=Path, required=True,
                         help="model directory whose tokenizer the trajectories use")
    collect.add_argument("--logs", type=Path, default=Path("runs/sft-collect"),
                         help="scripts file and session folders")
    collect.add_argument("--num-tasks", type=int, default=None, help="only the first N tasks")
    collect.add_argument("--task", action="append", default=[], help="only this instance_id")
    collect.add_argument("--concurrency", type=int, default=2)
    collect.add_argument("--timeout-s", type=float, default=300.0)
    collect.add_argument("--progress-interval-s", type=float, default=5.0)
    collect.set_defaults(handler=_sft_collect)


def _sft_collect(args) -> int:
    from undertow.sft_collect import CollectCommand, main

    return main(CollectCommand(
        tasks=args.tasks, out=args.out, model_dir=args.model, logs_dir=args.logs,
        num_tasks=args.num_tasks, instance_ids=tuple(args.task), concurrency=args.concurrency,
        timeout_s=args.timeout_s, docker_url=os.environ.get("DOCKER_HOST"),
        progress_interval_s=args.progress_interval_s))


def _add_plot(commands) -> None:
    plot = commands.add_parser("plot", help="draw a training run's metrics to PNG files")
    plot.add_argument("run", type=Path, help="run directory (holding metrics.jsonl)")
    plot.add_argument("--out", type=Path, default=None, help="folder (default: RUN/plots)")
    plot.set_defaults(handler=_plot)


def _plot(args) -> int:
    from undertow.learner.plot import plot_run

    for path in plot_run(args.run, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="undertow", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_model, _add_simulate, _add_sandbox, _add_tasks, _add_trees, _add_train,
                _add_sft, _add_sft_collect, _add_plot):
        add(commands)
    for name in COMMAND_MODULES:
        importlib.import_module(f"undertow.commands.{name}").add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"undertow: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
