"""A rollout source for the crash-and-resume test (`test_crash_resume.py`): the default chat
rollouts, unchanged, and one moment of the run where `undertow train` stops dead, prints
`HANG MOMENT N` and blocks, so that the test kills it there (SIGKILL of its process group)
at exactly that moment. The moment is the test's environment variable `UNDERTOW_TEST_HANG`
(`MOMENT:N`, read here, in test code, when the source is made):

- `rollout:N`    group of launch index N has finished at the gateway (its sessions closed,
                 in the store) and is not yet handed to the learner;
- `train:N`      inside the learner's step that makes weights N, its gradient computed,
                 before the optimizer steps;
- `checkpoint:N` inside the checkpoint write of step N: its model written into the hidden
                 `.tmp-*` directory, nothing renamed;
- `push:N`       weights N written, before the gateway is asked to serve them.

The moments inside the learner are reached by wrapping public functions of this process
(`Learner.apply_gradient`, `checkpoint.write_model_dir`, `GatewayLink.push`), which the
run calls by those names; nothing else changes.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from undertow.run.rollout_source import chat_rollouts

VARIABLE = "UNDERTOW_TEST_HANG"


def _hang(moment: str, number: int) -> None:
    print(f"HANG {moment} {number}", flush=True)
    threading.Event().wait()   # until the test kills the process


def make_run_group(context):
    run_group = chat_rollouts(context)
    moment, _, number_text = os.environ.get(VARIABLE, "").partition(":")
    number = int(number_text) if number_text else -1
    if moment in ("train", "checkpoint", "push"):
        _install(moment, number)

    async def hanging_run_group(request):
        outcome = await run_group(request)
        if moment == "rollout" and request.index == number:
            print(f"HANG rollout {number}", flush=True)
            await asyncio.Event().wait()
        return outcome
    return hanging_run_group


def _install(moment: str, number: int) -> None:
    from undertow.learner import checkpoint
    from undertow.learner.gateway_link import GatewayLink
    from undertow.learner.train import Learner

    if moment == "train":
        apply_gradient = Learner.apply_gradient

        def hanging_apply_gradient(self, trees, stats):
            if self.state.step + 1 == number:
                _hang("train", number)
            return apply_gradient(self, trees, stats)
        Learner.apply_gradient = hanging_apply_gradient   # type: ignore[method-assign]
    elif moment == "checkpoint":
        write_model_dir = checkpoint.write_model_dir

        def hanging_write_model_dir(model, base_model_dir, out):
            written = write_model_dir(model, base_model_dir, out)
            folder = Path(out).parent
            if folder.parent.name == checkpoint.CHECKPOINTS and \
                    folder.name.startswith(f".tmp-step-{number:06d}"):
                _hang("checkpoint", number)
            return written
        checkpoint.write_model_dir = hanging_write_model_dir
    else:
        push = GatewayLink.push

        def hanging_push(self, model_dir, weight_version):
            if weight_version == number:
                _hang("push", number)
            return push(self, model_dir, weight_version)
        GatewayLink.push = hanging_push   # type: ignore[method-assign]
