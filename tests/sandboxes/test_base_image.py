"""The base image: built offline once, then reused; what it holds."""

import pytest

from undertow.sandboxes.base_image import BaseImageRecipe, apt_mirror, build_base_image
from undertow.sandboxes.sandbox import Sandbox


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

