"""Fixture rows in the shape of each SWE dataset (written here; nothing is downloaded).

Each dataset gets rows that must be kept and rows that must be dropped, with the reason
the import report must give. `TEST_PATCH` adds `tests/test_new.py`.
"""

import json

TEST_PATCH = ("diff --git a/tests/test_new.py b/tests/test_new.py\nnew file mode 100644\n"
              "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1,2 @@\n+def test_new():\n"
              "+    assert True\n")
PATCH = "diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n"


def swe_bench_row(instance_id: str, repo: str, version: str, f2p, p2p=(), **extra) -> dict:
    """A SWE-bench row: list fields as JSON strings, as the Hugging Face dataset stores them."""
    return {"repo": repo, "instance_id": instance_id, "base_commit": "a" * 40, "patch": PATCH,
            "test_patch": TEST_PATCH, "problem_statement": f"{instance_id} is broken",
            "hints_text": "", "created_at": "2023-01-01T00:00:00Z", "version": version,
            "FAIL_TO_PASS": json.dumps(list(f2p)), "PASS_TO_PASS": json.dumps(list(p2p)),
            "environment_setup_commit": "b" * 40, **extra}


SWE_BENCH = [
    swe_bench_row("django__django-11099", "django/django", "3.0",
                  ["test_new (tests.test_new.T)"], ["test_old (tests.test_old.T)"]),
    swe_bench_row("sympy__sympy-20590", "sympy/sympy", "1.7", ["test_new"]),
    swe_bench_row("acme__widgets-7", "acme/widgets", "0.1", ["tests/test_new.py::test_new"]),
    swe_bench_row("django__django-1", "django/django", "3.0", []),
    swe_bench_row("django__django-11099", "django/django", "3.0", ["x"]),
    {**swe_bench_row("django__django-2", "django/django", "3.0", ["x"]), "FAIL_TO_PASS": "[x"},
]
SWE_BENCH_KEPT = ["django__django-11099", "sympy__sympy-20590", "acme__widgets-7"]
SWE_BENCH_DROPPED = {"no FAIL_TO_PASS tests": 1, "repeats an earlier instance_id": 1,
                     "FAIL_TO_PASS is not a JSON list": 1}

SWE_BENCH_MULTILINGUAL = [
    swe_bench_row("caddyserver__caddy-6411", "caddyserver/caddy", "6411", ["TestReplacerNew"]),
    swe_bench_row("burntsushi__ripgrep-2576", "burntsushi/ripgrep", "2576", ["regression::r1"]),
]

SWE_GYM = [
    {**swe_bench_row("getmoto__moto-5752", "getmoto/moto", "4.0", []),
     "FAIL_TO_PASS": ["tests/test_new.py::test_new"], "PASS_TO_PASS": []},
    {**swe_bench_row("Project-MONAI__MONAI-2696", "Project-MONAI/MONAI", "0.6", []),
     "FAIL_TO_PASS": ["tests/test_new.py::test_new"], "PASS_TO_PASS": []},
    {**swe_bench_row("pandas-dev__pandas-1", "pandas-dev/pandas", "2.0", []),
     "problem_statement": None, "FAIL_TO_PASS": ["t"]},
]

SWE_SMITH = [
    {"instance_id": "getmoto__moto.694ce1f4.func_pm_op_swap__abc", "repo":
     "swesmith/getmoto__moto.694ce1f4", "patch": PATCH, "problem_statement": "moto breaks",
     "FAIL_TO_PASS": ["tests/test_core.py::test_a"], "PASS_TO_PASS": ["tests/test_core.py::b"],
     "created_at": "2025-01-01", "image_name": "jyangballin/swesmith.x86_64.getmoto_1776_moto"
     ".694ce1f4", "base_commit": "c" * 40},
    {"instance_id": "pallets__flask.bc098406.lm_rewrite__xyz", "repo":
     "swesmith/pallets__flask.bc098406", "patch": PATCH, "problem_statement": "flask breaks",
     "FAIL_TO_PASS": ["tests/test_basic.py::test_a"], "PASS_TO_PASS": []},
    {"instance_id": "pallets__flask.bc098406.bad", "repo": "swesmith/pallets__flask.bc098406",
     "patch": PATCH, "problem_statement": "nothing to test", "FAIL_TO_PASS": [],
     "PASS_TO_PASS": []},
]

R2E_GYM = [
    {"repo_name": "orange3", "commit_hash": "d" * 40, "docker_image":
     f"namanjain12/orange3_final:{'d' * 40}", "problem_statement": "Orange breaks",
     "expected_output_json": json.dumps({"r2e_tests/test_1.py::test_a": "PASSED",
                                         "r2e_tests/test_1.py::test_b": "FAILED"}),
     "modified_files": ["Orange/widget.py"]},
    {"repo_name": "pillow", "commit_hash": "e" * 40, "problem_statement": "Pillow breaks",
     "expected_output_json": json.dumps({"r2e_tests/test_2.py::test_c": "PASSED"})},
    {"repo_name": "pillow", "commit_hash": "f" * 40, "problem_statement": "no tests",
     "expected_output_json": "not json"},
]

SWE_REBENCH = [
    {**swe_bench_row("owner__lib-12", "owner/lib", "1.0", ["tests/test_new.py::test_new"]),
     "install_config": {"python": "3.10", "install": "pip install -e .", "test_cmd":
                        "pytest --no-header -rA --tb=no -p no:cacheprovider",
                        "log_parser": "parse_log_pytest", "pre_install": ["apt-get update"]},
     "docker_image": "swerebench/sweb.eval.x86_64.owner_1776_lib-12"},
    {**swe_bench_row("owner__lib-13", "owner/lib", "1.0", ["tests/test_new.py::test_new"]),
     "install_config": None},
    {**swe_bench_row("owner__lib-14", "owner/lib", "1.0", ["t"]), "repo": None},
]

ROWS = {"swe-bench": SWE_BENCH, "swe-bench-lite": SWE_BENCH[:3],
        "swe-bench-verified": SWE_BENCH[:3], "swe-bench-multilingual": SWE_BENCH_MULTILINGUAL,
        "swe-gym": SWE_GYM, "swe-smith": SWE_SMITH, "r2e-gym": R2E_GYM,
        "swe-rebench": SWE_REBENCH}
