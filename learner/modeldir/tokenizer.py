"""Training the byte-level BPE tokenizer, with the chat template's special tokens.

Every byte is in the base alphabet and no normalizer runs, so any text encodes
and decodes back to itself exactly (the gateway's token truth relies on it).
The chat markers are single tokens: `<|im_start|>`, `<|im_end|>` and
`<|endoftext|>` are special (dropped by `skip_special_tokens`), while the
tool-call, tool-response and thinking tags are ordinary added tokens, so that a
decoded completion still shows them to the tool-call parser.

BPE training has no randomness: the same corpus gives the same `tokenizer.json`.
"""

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<think>", "</think>")

# Pieces the merges never cross: contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newline runs and other whitespace.
SPLIT_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
MIN_PAIR_FREQUENCY = 2


def _empty_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A tokenizer of at most `vocab_size` tokens, chat tokens included, trained on `texts`.

    A small corpus yields fewer merges than asked for; the tokenizer is then smaller.
    """
    num_reserved = len(SPECIAL_TOKENS) + len(TAG_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < num_reserved:
        raise ValueError(f"vocab_size={vocab_size} is below the {num_reserved} tokens that "
                         "every tokenizer needs (bytes and chat tokens); ask for more")
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=MIN_PAIR_FREQUENCY,
        special_tokens=[AddedToken(token, special=True, normalized=False)
                        for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in TAG_TOKENS])
    return tokenizer
