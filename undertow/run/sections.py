"""The sections of one training run's config, typed: `RunSections`, built in one place.

`undertow train` reads its config once (`load_sections`: the file, or on resume the latest
checkpoint's, then the overrides) into one frozen dataclass per section, every section
built in one pass, defaults included, and `undertow/run/train.py` hands each part only
its own (docs/design.md, "From `undertow train` to the loss"). The run-level sections are
defined here (`RunConfig`, `RolloutSection`, `WarmStartSection`), the learner's in
`learner/config.py`. `RunSections.resolved`, worked out when the sections are built, is
what a checkpoint stores as `config.yaml`; building it again gives the same sections, so
a resume continues the run.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undertow.cells.config import CellPoolConfig
from undertow.config import build_section, dataclass_of, read_config
from undertow.learner.config import AdvantageConfig, LossConfig, TrackerConfig, TrainConfig
from undertow.sandboxes.hosts import HostsConfig
from undertow.sandboxes.sandbox import SandboxConfig

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "learn.yaml"


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives and what it serves. `model_dir` None: the tiny model, built
    once into `run_dir/model-base`; `engine_urls` empty: one built-in engine."""

    run_dir: Path = Path("runs/train")
    model_dir: Path | None = None
    engine_urls: tuple[str, ...] = ()
    docker_url: str | None = None


@dataclass(frozen=True)
class RolloutSection:
    """The rollouts of each group: `scaffold` on the tasks of `tasks` (default: the
    bundled set; for `chat`, `adapters/configs/directions.yaml`), one task a group, each
    pass over the tasks in an order shuffled from `seed` (`shuffle: false`: the set's
    order). A session that Undertow fails is run again as a
    new session of its group, up to `max_attempts` attempts per slot. `sandbox` is each
    session's container (`sandboxes/sandbox.py` SandboxConfig: cpus, memory, network,
    git_history), e.g. `rollout.sandbox.memory_bytes=4294967296`."""

    tasks: Path | None = None
    num_tasks: int | None = None
    instance_ids: tuple[str, ...] = ()
    scaffold: str = "mini-swe-agent"
    scaffold_options: dict = field(default_factory=dict)
    concurrency: int = 2
    timeout_s: float = 600.0
    timeout_value: str = "partial_credit"
    source: str = ""
    max_attempts: int = 3
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    shuffle: bool = True
    seed: int = 0


@dataclass(frozen=True)
class WarmStartSection:
    """`num_steps` optimiser steps (each on every task's replies) at `lr`."""

    num_steps: int = 30
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self):
        if self.num_steps < 0:
            raise ValueError(f"warm_start.num_steps must be >= 0, got {self.num_steps}")
        if self.lr <= 0:
            raise ValueError(f"warm_start.lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class RunSections:
    """Every section of a run config, each its part's frozen dataclass (defaults where
    the config leaves a section out): the run's own, then the learner's, then the
    sandboxes'. `pool` is None unless the config has a `pool` section, which makes the
    run a cell-pool run. `resolved` is not a section: the sections as YAML-safe data
    (paths as strings, tuples as lists), every key filled in, which is what a checkpoint
    stores; `from_tree` of it gives these sections."""

    run: RunConfig = field(default_factory=RunConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    learner: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    logging: TrackerConfig = field(default_factory=TrackerConfig)
    sandbox: HostsConfig = field(default_factory=HostsConfig)
    pool: CellPoolConfig | None = None
    resolved: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tree = {name: dataclasses.asdict(getattr(self, name)) for name in section_names()
                if getattr(self, name) is not None}
        object.__setattr__(self, "resolved", json.loads(json.dumps(tree, default=str)))

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> RunSections:
        """The sections of a config tree (`config.read_config`), each built here, a
        section the tree leaves out from its defaults (`pool`: None). An unknown section,
        or an unknown key or bad value in one, is a ValueError naming it (`section.key`)."""
        names = section_names()
        unknown = sorted(set(tree) - set(names))
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; known: {list(names)}")
        hints = typing.get_type_hints(cls)
        sections = {}
        for section in dataclasses.fields(cls):
            if section.init and (section.name in tree or section.default is not None):
                sections[section.name] = build_section(_section_class(hints[section.name]),
                                                       tree.get(section.name), section.name)
        return cls(**sections)


def _section_class(hint: object) -> type:
    """The dataclass of a `RunSections` field (`X` or `X | None`)."""
    found = dataclass_of(hint)
    if found is None:
        raise TypeError(f"RunSections field of type {hint} is no dataclass: make it one")
    return found


def section_names() -> tuple[str, ...]:
    """The sections a run config may have, in `RunSections`' order."""
    return tuple(section.name for section in dataclasses.fields(RunSections) if section.init)


def load_sections(config_path: Path | None, overrides: list[str], run_dir: Path | None = None,
                  resume: bool = False) -> RunSections:
    """The run's sections: `config_path` (default `configs/learn.yaml`) and `overrides`,
    `run_dir` setting `run.run_dir`. On resume without a config file, the config the
    latest checkpoint of `run.run_dir` stored, with the same overrides."""
    if run_dir is not None:
        overrides = [*overrides, f"run.run_dir={run_dir}"]
    sections = RunSections.from_tree(read_config(config_path or DEFAULT_CONFIG, overrides))
    if resume and config_path is None:
        from undertow.learner.checkpoint import latest_checkpoint

        latest = latest_checkpoint(sections.run.run_dir)
        if latest is not None:
            return RunSections.from_tree(read_config(latest / "config.yaml", overrides))
    return sections
