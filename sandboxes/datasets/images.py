"""Which of a task set's images are not on the Docker host, and the command that gets each.

Datasets name published images (`formats.py`); Undertow does not pull them itself (a run
must not depend on a registry). `missing_images` lists the absent ones with their dataset's
command, so that a user can fetch or build them before a rollout.
"""

import docker
import docker.errors

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.datasets.formats import DatasetFormat, image_fields
from undertow.sandboxes.task import Task, task_record


def how_to_get(task: Task, dataset: DatasetFormat) -> str:
    """The sentence that names a missing image and the command that gets it."""
    fields = {**image_fields(task_record(task)), "image": task.image}
    return (f"task {task.instance_id}: image {task.image} is not on this Docker host; get it "
            f"with: {dataset.get_image.format(**fields)}")


def _is_present(client: docker.DockerClient, image: str) -> bool:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


async def missing_images(connection: Connection, tasks: list[Task],
                         dataset: DatasetFormat) -> list[str]:
    """One `how_to_get` sentence per task whose image the host lacks."""
    missing = []
    for task in tasks:
        if task.image and not await connection.call(_is_present, connection.client, task.image):
            missing.append(how_to_get(task, dataset))
    return missing
