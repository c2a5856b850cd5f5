"""The offline model directory: it loads with transformers, is deterministic, and its
tokenizer round-trips any text and keeps the chat markers as single tokens."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from undertow.learner.modeldir import (
    SIZES,
    init_model_dir,
    train_tokenizer,
    write_model_config,
    write_tokenizer_files,
)
from undertow.learner.modeldir.corpus import (
    freeze_corpus,
    list_corpus,
    read_frozen_corpus,
)
from undertow.learner.modeldir.sizes import MAX_POSITION_EMBEDDINGS
from undertow.learner.modeldir.tokenizer import SPECIAL_TOKENS, TAG_TOKENS
from undertow.learner.modeldir.weights import write_weights

REPO = Path(__file__).resolve().parents[2]
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "special_tokens_map.json")
ROUND_TRIP_TEXTS = (
    "",
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}  # ok\r\n",
    "naïve café, Straße, ǅ, e\u0301 (decomposed), 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 and zero\u200bwidth, nul \x00 byte, bell \x07, \U0010fffd",
    "don't . , ? ! spaces   before   punctuation ,  and trailing   ",
    '{"name": "bash", "arguments": {"command": "ls -la | grep \\"x\\""}}',
    "    indented\n        more\n\n\n\ttabs\t\tand\u00a0nbsp\u3000ideographic space",
    "1234567890 3.14159 0xDEADBEEF 1e-9",
)


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    """The frozen corpus that `init_model_dir` trains on."""
    return read_frozen_corpus()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)


def test_directory_has_the_hugging_face_files(tiny_model_dir):
    assert {path.name for path in tiny_model_dir.iterdir()} == set(FILES)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] >= 32768
    assert config["vocab_size"] % 64 == 0
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert config["vocab_size"] - 64 < tokenizer.get_vocab_size() <= config["vocab_size"]
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "<tool_call>" in tokenizer_config["chat_template"]


def test_loads_offline_with_transformers(tiny_model_dir, offline):
    import torch

    tokenizer, model = _load(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.model_max_length == MAX_POSITION_EMBEDDINGS
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id,
                                                    tokenizer.pad_token_id]
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (model.config.head_dim,)
    prompts = ["def main():", "The quick brown fox", "import torch\n", "<tool_call>\n{"]
    next_ids = set()
    with torch.no_grad():
        for prompt in prompts:
            input_ids = tokenizer(prompt, return_tensors="pt").input_ids
            logits = model(input_ids).logits  # (1, T, V)
            assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
            assert torch.isfinite(logits).all()
            assert logits[0, -1].std() > 0.05
            next_ids.add(int(logits[0, -1].argmax()))
    assert len(next_ids) > 1, "the untrained model predicts the same token for every prompt"


def test_tiny_has_about_five_million_parameters(tiny_model_dir, offline):
    _, model = _load(tiny_model_dir)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == SIZES["tiny"].num_parameters(model.config.vocab_size)
    assert 3_000_000 <= num_parameters <= 6_000_000


@pytest.mark.slow
def test_small_has_30_to_60_million_parameters(tmp_path, offline):
    model_dir = init_model_dir(tmp_path / "small", size="small", seed=0)
    _, model = _load(model_dir)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == SIZES["small"].num_parameters(model.config.vocab_size)
    assert 30_000_000 <= num_parameters <= 60_000_000


def test_the_qwen2_5_7b_shape_has_its_own_head_and_7_6_billion_parameters(tiny_model_dir,
                                                                            tmp_path):
    """The config `undertow model init --size qwen2.5-7b` writes (the weights are not
    drawn here: the model is built on the meta device to count its parameters)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    write_model_config(tmp_path, SIZES["qwen2.5-7b"], tokenizer)
    config = Qwen3Config.from_pretrained(tmp_path)
    assert not config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.num_key_value_heads) == (152064, 3584, 4)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == SIZES["qwen2.5-7b"].num_parameters(config.vocab_size)
    assert 7_500_000_000 <= num_parameters <= 7_700_000_000


def test_tiny_untied_stores_its_own_head(tmp_path, tiny_model_dir):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    write_model_config(tmp_path, SIZES["tiny-untied"], tokenizer)
    write_weights(tmp_path, seed=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert "lm_head.weight" in set(stored.keys())
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == SIZES["tiny-untied"].num_parameters(model.config.vocab_size)
    assert num_parameters > SIZES["tiny"].num_parameters(model.config.vocab_size)


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="size='huge'"):
        init_model_dir(tmp_path / "huge", size="huge")


def _weights_for_seed(tiny_model_dir: Path, model_dir: Path, seed: int) -> bytes:
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    return write_weights(model_dir, seed=seed).read_bytes()


def test_weights_depend_only_on_the_seed(tiny_model_dir, tmp_path):
    first = _weights_for_seed(tiny_model_dir, tmp_path / "first", seed=0)
    again = _weights_for_seed(tiny_model_dir, tmp_path / "again", seed=0)
    other = _weights_for_seed(tiny_model_dir, tmp_path / "other", seed=1)
    assert first == again == (tiny_model_dir / "model.safetensors").read_bytes()
    assert first != other
    with safe_open(tmp_path / "first" / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    with safe_open(tmp_path / "other" / "model.safetensors", "pt") as weights:
        assert not embedding.equal(weights.get_tensor("model.embed_tokens.weight"))


def test_tokenizer_files_are_byte_identical_across_runs(corpus_texts, tmp_path):
    for name in ("first", "again"):
        (tmp_path / name).mkdir()
        tokenizer = train_tokenizer(corpus_texts, vocab_size=SIZES["tiny"].max_vocab_size)
        write_tokenizer_files(tmp_path / name, tokenizer, max_length=MAX_POSITION_EMBEDDINGS)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_tokenizer_training_is_identical_across_processes(corpus_texts, tmp_path):
    # Rust hash maps are seeded per process; ties between merges must not depend on it.
    snapshot = tmp_path / "corpus.json"
    snapshot.write_text(json.dumps(corpus_texts))
    script = ("import hashlib, json, sys\n"
              "from undertow.learner.modeldir import train_tokenizer\n"
              "texts = json.loads(open(sys.argv[1]).read())\n"
              "print(hashlib.sha256(train_tokenizer(texts, 8192).to_str().encode()).hexdigest())\n")
    here = hashlib.sha256(train_tokenizer(corpus_texts, 8192).to_str().encode()).hexdigest()
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script, str(snapshot)], check=True,
                                capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == here


def test_corpus_is_the_repositorys_own_text_in_sorted_order():
    files = list_corpus()
    names = [corpus_file.name for corpus_file in files]
    assert names == sorted(names)
    assert "learner/modeldir/tokenizer.py" in names
    assert all(name.endswith((".py", ".md")) for name in names)
    assert not any("/." in name or name.startswith(".") or "__pycache__" in name
                   for name in names)
    assert all(corpus_file.path.resolve().is_relative_to(REPO) for corpus_file in files)


# The tiny tokenizer, pinned: it is trained on the frozen corpus only, so no edit of the
# code changes it. Refreezing the corpus on purpose changes this hash.
TINY_TOKENIZER_SHA256 = "e7c860d6d536e4bacb689ec2318de97fb05f9b381259437b8c41b16ae144d397"


def test_tiny_tokenizer_does_not_change_with_the_code(corpus_texts):
    trained = train_tokenizer(corpus_texts, vocab_size=SIZES["tiny"].max_vocab_size)
    assert hashlib.sha256(trained.to_str().encode()).hexdigest() == TINY_TOKENIZER_SHA256


def test_freeze_writes_a_checkouts_files_and_reads_them_back_in_order(tmp_path):
    root = tmp_path / "checkout"
    for folder in ("gateway", "adapters", "learner", "sandboxes", "undertow"):
        (root / folder).mkdir(parents=True)
    (root / "learner" / "b.py").write_text("second = 2\n")
    (root / "gateway" / "a.md").write_text("# first, naïve\n")
    (root / "gateway" / "skip.txt").write_text("not text of the corpus")
    frozen = tmp_path / "corpus.json.xz"
    assert freeze_corpus(frozen, root=root) == 2
    assert read_frozen_corpus(frozen) == ["# first, naïve\n", "second = 2\n"]
    with pytest.raises(FileNotFoundError, match="--freeze"):
        read_frozen_corpus(tmp_path / "absent.json.xz")


def test_the_default_runs_rewarded_answer_is_one_token(tiny_model_dir, offline):
    # A multi-token rewarded reply lets the tiny model raise its tokens everywhere
    # (adapters/configs/directions.yaml): the default run's answer must stay one token.
    import yaml
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tasks = yaml.safe_load((REPO / "adapters" / "configs" / "directions.yaml").read_text())
    for task in tasks:
        assert len(tokenizer.encode(task["answer"])) == 1, task["answer"]


def test_chat_tokens_are_single_ids(tiny_model_dir, offline):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {}
    for token in (*SPECIAL_TOKENS, *TAG_TOKENS):
        ids[token] = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer.encode(token, add_special_tokens=False) == [ids[token]]
        assert ids[token] in tokenizer.encode(f"x{token}y", add_special_tokens=False)
    assert len(set(ids.values())) == len(ids)
    text = '<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>'
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                               skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_any_text_round_trips(tiny_model_dir, offline, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text
    if text.isascii():  # a multi-byte character may be split across tokens
        assert "".join(tokenizer.decode([token_id]) for token_id in token_ids) == text


def test_repository_code_round_trips_and_compresses(tiny_model_dir, offline):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = (REPO / "learner" / "modeldir" / "tokenizer.py").read_text()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text
    assert len(token_ids) < len(text.encode()) / 2


def test_cli_writes_a_loadable_directory(tmp_path):
    out = tmp_path / "cli-model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "undertow.cli", "model", "init", "--out", str(out),
         "--size", "tiny", "--seed", "7"],
        capture_output=True, text=True, env=env, timeout=300, check=True)
    assert result.stdout.strip() == str(out)
    assert {path.name for path in out.iterdir()} == set(FILES)
    check = ("import sys\n"
             "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
             "AutoTokenizer.from_pretrained(sys.argv[1])\n"
             "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)\n")
    loaded = subprocess.run([sys.executable, "-W", "error", "-c", check, str(out)],
                            capture_output=True, text=True, env=env, timeout=300, check=True)
    assert loaded.stdout.strip().splitlines()[-1] == "Qwen3ForCausalLM"
