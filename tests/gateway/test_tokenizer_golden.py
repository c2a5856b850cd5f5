"""Golden tokenizations: the tokenizer the gateway uses (`tokenizers` over a model's real
`tokenizer.json`, `Renderer.encode`) gives llama.cpp's reference token IDs
(`models/ggml-vocab-NAME.gguf.inp` / `.gguf.out` in the llama-cpp-python sdist, written by
llama.cpp's own tokenizer, no BOS), and gpt-oss's gives what `openai-harmony` gives.

A tokenizer is paired with a reference only when its vocabulary and merges are the GGUF's
(checked first, from the GGUF itself): qwen2 with Qwen3's and Qwen2.5-Coder's
tokenizer.json, llama-bpe with @lenml llama3_1's. deepseek-llm (102,400 tokens) and
deepseek-coder (32,256) are other vocabularies than DeepSeek-V3's (128,000 + added), and
starcoder's is not SmolLM2's (both 49,152 tokens), so none of those is paired. The qwen35
reference has Qwen2's vocabulary and merges but no normalizer: Qwen3's tokenizer.json
applies NFC, so the inputs written decomposed (`e` + U+0301) tokenize otherwise; without
its normalizer it gives every reference.

The assets come from `make setup-assets` (and `make setup-models` for the Qwen2.5-Coder
directory).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.gateway.templates import LLAMA_CPP_MODELS, asset, lenml_tokenizer
from undertow.gateway.render import Renderer, encode_ids

SEPARATOR = "\n__ggml_vocab_test__\n"
# The sha256 of o200k_base.tiktoken that openai-harmony checks a downloaded or local copy
# against (the hash is in its compiled library).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_O200K_BASE = 199_998  # ranks of o200k_base; 199,998 on are harmony's special tokens


def reference(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's (text, token IDs) pairs for vocabulary NAME."""
    stem = LLAMA_CPP_MODELS / f"ggml-vocab-{name}.gguf"
    texts = asset(Path(f"{stem}.inp")).read_text(encoding="utf-8").split(SEPARATOR)
    lines = Path(f"{stem}.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and len(lines) >= len(texts) - 1, name
    return [(text, [int(i) for i in line.split()]) for text, line in
            zip(texts[:-1], lines[:len(texts) - 1], strict=True)]


def gguf_vocabulary(name: str) -> tuple[list[str], list[str]]:
    """The tokens and merges of a vocab-only GGUF, read from its key-value header."""
    values = _gguf_header(asset(LLAMA_CPP_MODELS / f"ggml-vocab-{name}.gguf").read_bytes())
    return values["tokenizer.ggml.tokens"], values.get("tokenizer.ggml.merges", [])


# GGUF value types (the GGUF specification): fixed-size scalars by struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _gguf_header(data: bytes) -> dict:
    """The key-value pairs of a GGUF file (version 2 or 3, little-endian): a small reader
    of its own: `gguf.GGUFReader` took 40-90 s here to index 280k merges."""
    assert data[:4] == b"GGUF", "not a GGUF file"
    num_values = struct.unpack_from("<Q", data, 16)[0]
    offset, values = 24, {}
    for _ in range(num_values):
        key, offset = _gguf_string(data, offset)
        kind = struct.unpack_from("<I", data, offset)[0]
        values[key], offset = _gguf_value(data, offset + 4, kind)
    return values


def _gguf_string(data: bytes, offset: int) -> tuple[str, int]:
    length = struct.unpack_from("<Q", data, offset)[0]
    start = offset + 8
    return data[start:start + length].decode("utf-8"), start + length


def _gguf_value(data: bytes, offset: int, kind: int):
    if kind == _STRING:
        return _gguf_string(data, offset)
    if kind == _ARRAY:
        item_kind, length = struct.unpack_from("<IQ", data, offset)
        offset, items = offset + 12, []
        for _ in range(length):
            item, offset = _gguf_value(data, offset, item_kind)
            items.append(item)
        return items, offset
    fmt = "<" + _SCALARS[kind]
    return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)


def json_vocabulary(tokenizer_file: Path) -> tuple[dict[int, str], list[str]]:
    raw = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    tokens = {index: token for token, index in raw["model"]["vocab"].items()}
    tokens.update({added["id"]: added["content"] for added in raw["added_tokens"]})
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    return tokens, merges


def mismatches(tokenizer: Tokenizer, pairs) -> list[str]:
    """The texts that either the tokenizer's `encode` or the gateway's (`encode_ids`, which
    leaves out the offsets) tokenizes otherwise than the reference."""
    return [text for text, token_ids in pairs
            if tokenizer.encode(text, add_special_tokens=False).ids != token_ids
            or encode_ids(tokenizer, text) != token_ids]


@pytest.fixture(scope="module")
def qwen3_tokenizer_file() -> Path:
    return lenml_tokenizer("qwen3")


PAIRED = {"qwen2": "qwen3", "llama-bpe": "llama3_1"}


@pytest.mark.parametrize("name", sorted(PAIRED))
def test_paired_tokenizers_have_the_reference_vocabulary(name):
    """A pairing is only meaningful on the same vocabulary: tokens and merges as in the
    GGUF (the GGUF pads Qwen's unused IDs past the added tokens as [PADn]; those are the
    only tokens that may differ, and only among the special ones)."""
    gguf_tokens, gguf_merges = gguf_vocabulary(name)
    tokens, merges = json_vocabulary(lenml_tokenizer(PAIRED[name]))
    assert merges == gguf_merges
    differing = [i for i, token in enumerate(gguf_tokens) if tokens.get(i) != token]
    assert all(gguf_tokens[i].startswith("[PAD") for i in differing), differing[:5]
    num_base = len(json.loads(lenml_tokenizer(PAIRED[name]).read_text())["model"]["vocab"])
    assert all(i >= num_base for i in differing)


@pytest.mark.parametrize("name", ["deepseek-llm", "deepseek-coder"])
def test_deepseek_references_are_another_vocabulary_than_v3s(name):
    gguf_tokens, _ = gguf_vocabulary(name)
    tokens, _ = json_vocabulary(lenml_tokenizer("deepseek_v3"))
    assert len(gguf_tokens) < 128_000 <= len(tokens)
    num_same = sum(tokens.get(i) == token for i, token in enumerate(gguf_tokens))
    assert num_same < len(gguf_tokens) // 10  # not a prefix of V3's either


@pytest.mark.parametrize("name", sorted(PAIRED))
def test_the_gateway_tokenizer_reproduces_llama_cpp(name):
    pairs = reference(name)
    assert len(pairs) >= 40
    assert mismatches(Tokenizer.from_file(str(lenml_tokenizer(PAIRED[name]))), pairs) == []


def test_qwen25_coder_directory_reproduces_the_qwen2_reference(qwen_coder_dir):
    """The pretrained directory's own tokenizer, through the gateway's `Renderer`."""
    renderer = Renderer(asset(qwen_coder_dir, "make setup-models"))
    for text, token_ids in reference("qwen2"):
        assert renderer.encode(text) == token_ids, text


def test_qwen35_reference_differs_only_by_qwen3s_nfc_normalizer(qwen3_tokenizer_file):
    pairs = reference("qwen35")
    gguf_tokens, gguf_merges = gguf_vocabulary("qwen35")
    assert (gguf_tokens, gguf_merges) == gguf_vocabulary("qwen2")
    raw = json.loads(qwen3_tokenizer_file.read_text(encoding="utf-8"))
    assert raw["normalizer"] == {"type": "NFC"}
    decomposed = [text for text, _ in pairs if unicodedata.normalize("NFC", text) != text]
    assert len(decomposed) >= 3
    assert sorted(mismatches(Tokenizer.from_str(json.dumps(raw)), pairs)) == sorted(decomposed)
    raw["normalizer"] = None
    assert mismatches(Tokenizer.from_str(json.dumps(raw)), pairs) == []


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, back to bytes: printable bytes stand for themselves,
    the others for code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def o200k_base_file(tokenizer_file: Path, out: Path) -> Path:
    """`o200k_base.tiktoken` (base64 token bytes and rank per line) rebuilt from gpt-oss's
    tokenizer.json, whose first 199,998 IDs are o200k_base's ranks."""
    decoder = _byte_decoder()
    vocab = json.loads(tokenizer_file.read_text(encoding="utf-8"))["model"]["vocab"]
    by_rank = sorted((rank, token) for token, rank in vocab.items() if rank < NUM_O200K_BASE)
    assert [rank for rank, _ in by_rank] == list(range(NUM_O200K_BASE))
    lines = [base64.b64encode(bytes(decoder[c] for c in token)).decode() + f" {rank}\n"
             for rank, token in by_rank]
    path = out / "o200k_base.tiktoken"
    path.write_text("".join(lines), encoding="ascii")
    return path


@pytest.fixture(scope="module")
def harmony_encoding(tmp_path_factory):
    """openai-harmony's gpt-oss encoding, offline: TIKTOKEN_ENCODINGS_BASE names a folder
    with o200k_base.tiktoken (without it harmony downloads the file)."""
    openai_harmony = pytest.importorskip("openai_harmony")  # the test extra has it
    folder = tmp_path_factory.mktemp("tiktoken")
    o200k_base_file(lenml_tokenizer("gptoss"), folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        patch.setenv("TIKTOKEN_RS_CACHE_DIR", str(folder / "cache"))
        yield openai_harmony, openai_harmony.load_harmony_encoding(
            openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def test_gpt_oss_vocabulary_rebuilds_o200k_base_byte_for_byte(tmp_path):
    path = o200k_base_file(lenml_tokenizer("gptoss"), tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == O200K_BASE_SHA256


def test_gpt_oss_tokenizer_encodes_as_openai_harmony(harmony_encoding):
    """Every reference text of the byte-level vocabularies, and harmony's own markup,
    encode to the same IDs with the gateway's tokenizer as with harmony's."""
    _, encoding = harmony_encoding
    tokenizer = Tokenizer.from_file(str(lenml_tokenizer("gptoss")))
    texts = [text for name in ("qwen2", "qwen35", "llama-bpe") for text, _ in reference(name)]
    texts.append("<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json"
                 '<|message|>{"cmd": "ls"}<|call|>')
    for text in texts:
        expected = encoding.encode(text, allowed_special="all")
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text


def test_gpt_oss_template_renders_a_tool_call_turn_as_harmony(harmony_encoding, tiny_model_dir,
                                                             tmp_path):
    """The real gpt-oss template with the real tokenizer (the `harmony` family) writes an
    assistant tool call and its result with the token IDs harmony's renderer writes."""
    from tests.gateway.templates import FAMILIES, family_model_dir

    harmony, encoding = harmony_encoding
    renderer = Renderer(family_model_dir(tiny_model_dir, FAMILIES["harmony"], tmp_path / "m"))
    call = {"id": "c", "type": "function",
            "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
    messages = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    text = renderer.render(messages, add_generation_prompt=True)
    turns = text[text.index("<|start|>assistant to="):]
    expected = [
        harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, '{"cmd": "ls"}')
        .with_channel("commentary").with_recipient("functions.bash")
        .with_content_type("json"),
        harmony.Message.from_author_and_content(
            harmony.Author.new(harmony.Role.TOOL, "functions.bash"), '"ok"')
        .with_channel("commentary").with_recipient("assistant")]
    harmony_ids = [token_id for message in expected
                   for token_id in encoding.render(message)]
    assert renderer.encode(turns) == harmony_ids + encoding.encode("<|start|>assistant",
                                                                   allowed_special="all")
