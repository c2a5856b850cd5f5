"""`embedded.held_on`, the one bridge by which the sync runs hold async services (the
gateway with its engine in `train_run`, the engineless gateway in `cells`): entered and
exited on the background loop's thread, the block's error handed to the manager."""

import contextlib
import threading

import pytest

from undertow.run.embedded import held_on
from undertow.run.rollout_source import background_loop


def recording(events: list, suppress: bool = False):
    @contextlib.asynccontextmanager
    async def service():
        events.append(("enter", threading.current_thread().name))
        try:
            yield "service"
        except ValueError as error:
            events.append(("error", str(error)))
            if not suppress:
                raise
        finally:
            events.append(("exit", threading.current_thread().name))
    return service()


def test_entered_and_exited_on_the_loops_thread_around_the_block():
    events: list = []
    with background_loop() as loop, held_on(loop, recording(events)) as value:
        assert value == "service" and events == [("enter", "undertow-rollouts")]
    assert events[-1] == ("exit", "undertow-rollouts")


def test_the_blocks_error_reaches_the_manager_which_may_suppress_it():
    events: list = []
    with background_loop() as loop:
        with pytest.raises(ValueError, match="boom"), held_on(loop, recording(events)):
            raise ValueError("boom")
        with held_on(loop, recording(events, suppress=True)):
            raise ValueError("quiet")
    assert [e for e in events if e[0] == "error"] == [("error", "boom"), ("error", "quiet")]
    assert [e[0] for e in events].count("exit") == 2
