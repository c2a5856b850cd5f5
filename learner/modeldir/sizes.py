"""The model sizes `undertow model init` can build, as Qwen3 architecture shapes.

`tiny` (about 5M parameters) is what the tests and CPU benchmarks run; `small`
(about 33-40M) is big enough that decode throughput is compute-bound on a CPU;
`qwen3-0.6b` has Qwen3-0.6B's shape (28 layers, hidden 1024, 16 query and 8 key-value
heads of 128, MLP 3072, 151,936 embedding rows, tied head: 596M parameters) with
random weights, for the GPU check (`make device-check`). `tiny-untied` is `tiny` with an
LM head of its own (tests of sharding such heads), and `qwen2.5-7b` has Qwen2.5-7B's
shape (28 layers, hidden 3584, 28 query and 4 key-value heads of 128, MLP 18944, 152,064
embedding rows, an untied head: 7.6B parameters) in the Qwen3 architecture, which has
no q/k/v biases and adds q/k norms, for sizing a 7B run. The
embedding table is sized by the trained tokenizer (see `max_vocab_size`), so the
counts are reached once the repository's text is large enough (about 1 MB) to fill
the vocabulary; before that the models are somewhat smaller.
"""

from dataclasses import dataclass

ROPE_THETA = 1_000_000.0
MAX_POSITION_EMBEDDINGS = 40_960


@dataclass(frozen=True)
class ModelSize:
    """The shape of one Qwen3 model.

    Invariants: `num_attention_heads` is a multiple of `num_key_value_heads`;
    `max_vocab_size`, the tokenizer's training target, is a multiple of 64, so a
    tokenizer that reaches it fills the embedding table exactly.
    """

    max_vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    embedding_rows: int | None = None
    """The embedding table's rows when the copied shape fixes them (Qwen3-0.6B has more
    rows than its tokenizer's tokens, as here); None: the tokenizer's size rounded up."""
    tie_word_embeddings: bool = True
    """Whether the LM head shares the embedding's weight (Qwen3 up to 4B) or has its own."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.max_vocab_size % 64:
            raise ValueError(f"max_vocab_size={self.max_vocab_size} is not a multiple of 64")

    def num_parameters(self, vocab_size: int) -> int:
        """Parameters of the model with input (and, untied, output) embeddings of
        `vocab_size` rows."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (2 * q_size + 2 * kv_size) + 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embeddings = vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * (attention + mlp + norms) + self.hidden_size


SIZES = {
    "tiny": ModelSize(max_vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=768),
    "small": ModelSize(max_vocab_size=16384, hidden_size=512, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       intermediate_size=2048),
    "qwen3-0.6b": ModelSize(max_vocab_size=32768, hidden_size=1024, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                            intermediate_size=3072, embedding_rows=151936),
    "tiny-untied": ModelSize(max_vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             intermediate_size=768, tie_word_embeddings=False),
    "qwen2.5-7b": ModelSize(max_vocab_size=32768, hidden_size=3584, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                            intermediate_size=18944, embedding_rows=152064,
                            tie_word_embeddings=False),
}
