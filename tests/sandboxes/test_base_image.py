"""The base image: built offline once, then reused; built on first use, once; what it holds."""

import asyncio
import contextlib
import dataclasses
import uuid

import docker.errors
import pytest

from undertow.sandboxes.base_image import BaseImageRecipe, apt_mirror, build_base_image
from undertow.sandboxes.sandbox import Sandbox
from undertow.sandboxes.task_image import ensure_task_image


def test_apt_mirror_from_one_line_and_deb822_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    assert apt_mirror(tmp_path) == "http://deb.debian.org/debian"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n")
    assert apt_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://local/debian bookworm main\n")
    assert apt_mirror(tmp_path) == "http://local/debian"


def test_recipe_digest_changes_with_the_recipe():
    assert BaseImageRecipe().digest() == BaseImageRecipe().digest()
    assert BaseImageRecipe().digest() != BaseImageRecipe(packages=("python3",)).digest()


@pytest.mark.docker
async def test_second_build_reuses_the_image(docker_connection, base_image):
    again = await build_base_image(docker_connection)
    assert again.reused and again.tag == base_image


@pytest.mark.docker
async def test_base_image_has_python_git_pytest_and_a_non_root_user(
        docker_connection, docker_run, base_image):
    async with await Sandbox.start(docker_connection, base_image, run=docker_run,
                                   session="base", workdir="/home/agent") as box:
        result = await box.exec(
            "id -un; python --version; git --version; python -m pytest --version; ps --version",
            timeout_s=60)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "agent" and lines[1].startswith("Python 3.")
    assert "git version" in result.output and "pytest" in result.output



def _seed_tarball(client, image_tag: str, recipe: BaseImageRecipe, cache_dir) -> None:
    """Caches `image_tag`'s root file system as `recipe`'s debootstrap tarball, so that
    building `recipe` takes seconds (the lock and first-use logic are under test here,
    not debootstrap, which the `base_image` fixture has already run)."""
    container = client.containers.create(image_tag, command=["true"])
    try:
        with (cache_dir / f"base-{recipe.digest()}.tar").open("wb") as tarball:
            for chunk in container.export():
                tarball.write(chunk)
    finally:
        container.remove(force=True)


@pytest.mark.docker
async def test_task_image_builds_a_missing_base_image_once_under_concurrency(
        docker_connection, base_image, fixture_task, tmp_path, monkeypatch):
    client = docker_connection.client
    recipe = BaseImageRecipe(tag=f"undertow/base-firstuse:{uuid.uuid4().hex[:8]}")
    cache_dir = tmp_path / ".cache" / "undertow"
    cache_dir.mkdir(parents=True)
    _seed_tarball(client, base_image, recipe, cache_dir)
    monkeypatch.setenv("HOME", str(tmp_path))
    tasks = [dataclasses.replace(fixture_task, instance_id=f"firstuse-{uuid.uuid4().hex[:8]}-{i}",
                                 base_commit="")
             for i in range(3)]
    tags: list[str] = []
    try:
        tags += await asyncio.gather(*(ensure_task_image(docker_connection, task, recipe)
                                      for task in tasks))
        again = await build_base_image(docker_connection, recipe)
        assert again.reused
        base_layers = client.images.get(recipe.tag).attrs["RootFS"]["Layers"]
        for tag in tags:
            layers = client.images.get(tag).attrs["RootFS"]["Layers"]
            assert layers[:len(base_layers)] == base_layers, f"{tag} is not built on {recipe.tag}"
        # One import for three concurrent sessions: the image was created once.
        assert len(client.images.list(name=recipe.tag.split(":")[0])) == 1
    finally:
        for tag in [*tags, recipe.tag]:
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag, force=True)


@pytest.mark.docker
async def test_concurrent_builds_of_a_missing_base_image_build_it_once(
        docker_connection, base_image, tmp_path):
    client = docker_connection.client
    recipe = BaseImageRecipe(tag=f"undertow/base-lock:{uuid.uuid4().hex[:8]}")
    _seed_tarball(client, base_image, recipe, tmp_path)
    try:
        built = await asyncio.gather(*(build_base_image(docker_connection, recipe,
                                                        cache_dir=tmp_path) for _ in range(4)))
        assert sorted(image.reused for image in built) == [False, True, True, True]
        assert len({image.image_id for image in built}) == 1
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(recipe.tag, force=True)
