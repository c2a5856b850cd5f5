"""The warm start of a chat run: cross-entropy on each prompt task's `warm_start` replies.

From random weights group sampling almost never meets a rewarded reply (30 RL steps from
random weights learned nothing), so before the first step `undertow train` imitates every
listed reply equally (`learner/sft.py`), on trees built as the gateway records a chat call.
Section `warm_start` (`sections.WarmStartSection`; `num_steps: 0` turns it off); the model is
written once to `RUN/model-warm` and reused on resume (docs/design.md, the start weights).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.run.sections import WarmStartSection

if TYPE_CHECKING:
    from undertow.adapters.chat_rollout import PromptTask
    from undertow.gateway.trees.tree import Tree

WARM_START_FIELD = "warm_start"


def imitation_trees(tasks: Sequence[PromptTask], model_dir: Path) -> list[Tree]:
    """One tree per task that lists replies: a closed session per reply, each reply's
    tokens (and the turn end) as sampled tokens after the rendered prompt."""
    from undertow.gateway.render import Renderer
    from undertow.gateway.trees.tree import Tree

    renderer = Renderer(model_dir)
    (turn_end_id,) = renderer.encode(renderer.turn_end.strip())
    trees = []
    for task in tasks:
        replies = task.fields.get(WARM_START_FIELD) or []
        if not replies:
            continue
        prompt_ids = renderer.encode(renderer.render(task.messages, add_generation_prompt=True))
        tree = Tree(f"warm-start.{task.instance_id}")
        for number, reply in enumerate(replies):
            session = f"{task.instance_id}.{number}"
            completion_ids = renderer.encode(str(reply)) + [turn_end_id]
            tree.add_call(f"{session}.call", session, prompt_ids, completion_ids,
                          [0.0] * len(completion_ids), [0] * len(completion_ids))
            tree.close_session(session, 1.0)
        trees.append(tree)
    return trees


def warm_start(tasks: Sequence[PromptTask], base_model_dir: Path, out_dir: Path,
               section: WarmStartSection) -> Path:
    """The warm-started model directory (`out_dir`, trained once); `base_model_dir` when
    the section is off or no task lists replies."""
    from undertow.learner.config import SFTConfig
    from undertow.learner.sft import run_sft

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    trees = imitation_trees(tasks, base_model_dir)
    if section.num_steps == 0 or not trees:
        return base_model_dir
    print(f"undertow train: warm start, {section.num_steps} steps of cross-entropy on the "
          f"replies of {len(trees)} task(s) -> {out_dir}", flush=True)
    config = SFTConfig(num_epochs=section.num_steps, groups_per_step=len(trees), lr=section.lr,
                       seed=section.seed)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)   # left by an interrupted warm start
    run_sft(trees, base_model_dir, tmp, config)
    tmp.rename(out_dir)
    return out_dir
