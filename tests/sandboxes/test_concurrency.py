"""Sixteen sessions' containers at once on this machine, then all removed."""

import asyncio

import pytest

from undertow.sandboxes.sandbox import RUN_LABEL, Sandbox, gc

pytestmark = [pytest.mark.docker, pytest.mark.slow]

NUM_SESSIONS = 16


async def test_sixteen_sandboxes_at_once_then_none(docker_connection, docker_run, fixture_image):
    run = f"{docker_run}-sixteen"
    try:
        boxes = await asyncio.gather(*(
            Sandbox.start(docker_connection, fixture_image, run=run, session=f"s{index}")
            for index in range(NUM_SESSIONS)))
        results = await asyncio.gather(*(
            box.exec(f"echo {index} > mine.txt && python -c 'import minimath' && cat mine.txt",
                     timeout_s=120) for index, box in enumerate(boxes)))
        assert [result.output.strip() for result in results] == [
            str(index) for index in range(NUM_SESSIONS)]
        running = docker_connection.client.containers.list(
            filters={"label": f"{RUN_LABEL}={run}", "status": "running"})
        assert len(running) == NUM_SESSIONS
        await asyncio.gather(*(box.close() for box in boxes))
        assert docker_connection.client.containers.list(
            all=True, filters={"label": f"{RUN_LABEL}={run}"}) == []
    finally:
        await gc(docker_connection, run)
