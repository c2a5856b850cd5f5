"""The built-in engine's scheduler thread and the commands run on it (`Scheduler.call`)."""

import threading

from undertow.gateway.builtin_engine.model import CausalLM, load_weights
from undertow.gateway.builtin_engine.model_config import ModelConfig
from undertow.gateway.builtin_engine.radix_cache import RadixCache
from undertow.gateway.builtin_engine.scheduler import Scheduler


def test_a_command_its_caller_cancelled_is_skipped_and_the_thread_runs_on(tiny_model_dir):
    """A caller that stops waiting cancels its command's future (asyncio.wrap_future does,
    when the awaiting task is cancelled: a client gone, a health probe's timeout). The
    worker used to set that future's result anyway, which raised InvalidStateError and
    ended the worker thread, so the engine never generated again."""
    config = ModelConfig.from_dir(tiny_model_dir)
    scheduler = Scheduler(CausalLM(config, load_weights(tiny_model_dir, config)),
                          RadixCache(0), str, frozenset(), 4, lambda updates: None, "0")
    scheduler.start()
    try:
        started, release = threading.Event(), threading.Event()
        blocking = scheduler.call(lambda: started.set() or release.wait(10))
        assert started.wait(10)  # the worker is inside the first command
        ran = []
        cancelled = scheduler.call(lambda: ran.append("cancelled"))
        assert cancelled.cancel()
        release.set()
        assert blocking.result(10)
        assert scheduler.call(lambda: "after").result(10) == "after"
        assert scheduler.alive and ran == []
    finally:
        scheduler.stop()
