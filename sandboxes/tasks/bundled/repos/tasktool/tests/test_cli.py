import json

from tasktool.format import fit, render_table
from tasktool.model import Task


def test_add_list_done(run):
    assert run("add", "Pay rent", "--due", "+1m", "--priority", "3", "--tag", "home") == (0, "added #1\n")
    assert run("add", "Review PR", "--due", "friday")[1] == "added #2\n"
    status, output = run("list")
    assert status == 0
    assert "Pay rent" in output
    assert "in 2d" in output
    run("done", "1")
    assert "Pay rent" not in run("list")[1]
    assert "Pay rent" in run("list", "--all")[1]


def test_tag_and_filter(run):
    run("add", "a")
    run("add", "b")
    assert run("tag", "2", "work", "later") == (0, "#2 tags: later work\n")
    output = run("list", "tag:work")[1]
    assert " b" in output
    assert " a " not in output


def test_edit_and_clear_due(run):
    run("add", "x", "--due", "tomorrow")
    run("edit", "1", "--title", "y", "--due", "none", "--priority", "2")
    data = json.loads(run.path.read_text())
    assert data["tasks"][0]["title"] == "y"
    assert data["tasks"][0]["due"] is None
    assert data["tasks"][0]["priority"] == 2


def test_errors_exit_with_status_1(run):
    assert run("done", "7") == (1, "tasktool: there is no task #7; see 'tasktool list --all'\n")
    assert run("add", "x", "--due", "whenever")[0] == 1


def test_stats(run):
    run("add", "late", "--due", "2024-05-01")
    run("add", "fine")
    run("done", "2")
    assert run("stats")[1] == "2 tasks: 1 done, 1 open, 1 overdue\n"


def test_fit():
    assert fit("abc", 5) == "abc  "
    assert fit("abcdef", 6) == "abcdef"


def test_empty_table(run):
    assert run("list")[1] == "no tasks\n"


def test_table_rows_have_equal_width():
    from datetime import date

    tasks = [Task(1, "short"), Task(22, "a title", priority=2)]
    lines = render_table(tasks, date(2024, 5, 15), width=60).splitlines()
    assert {len(line) for line in lines} == {60}
