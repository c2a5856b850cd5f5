import io

import pytest

from tasktool.cli import main


class Runner:
    """Runs the CLI against one task file, on a fixed day."""

    def __init__(self, path, today):
        self.path = path
        self.today = today

    def __call__(self, *argv):
        out = io.StringIO()
        status = main(["--file", str(self.path), "--today", self.today, *argv], out=out, env={})
        return status, out.getvalue()


@pytest.fixture
def run(tmp_path):
    # 2024-05-15 is a Wednesday.
    return Runner(tmp_path / "tasks.json", "2024-05-15")
