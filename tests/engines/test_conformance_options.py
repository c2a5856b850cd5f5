"""The conformance suite's options (`tests/engines/test_conformance.py`): `--sglang-url`
with `--sglang-model`, the model the server runs, whose tokenizer, config and a second
checkpoint derived from it the suite then uses.

A built-in engine serving SmolLM2 stands in for the SGLang server (it speaks SGLang's API);
the suite runs in a pytest of its own, on the tests that depend on the model.
"""

import subprocess
import sys

import pytest

from tests.engines.sglang_types import REPO

MODEL_TESTS = ("text_prompts_are_tokenized or update_weights_from_disk_changes or "
               "bad_input_is_rejected")


@pytest.mark.slow
def test_the_sglang_target_runs_on_the_model_sglang_model_names(smollm2_dir, start_engine):
    with start_engine(smollm2_dir) as url:
        suite = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/engines/test_conformance.py", "--sglang-url", url,
             "--sglang-model", str(smollm2_dir), "-k", f"sglang and ({MODEL_TESTS})"],
            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert suite.returncode == 0, suite.stdout[-4000:]
    assert "3 passed" in suite.stdout, suite.stdout[-4000:]
