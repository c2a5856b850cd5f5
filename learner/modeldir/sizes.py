"""The model sizes `undertow model init` can build, as Qwen3 architecture shapes (`SIZES`).
The embedding table is sized by the trained tokenizer (`max_vocab_size`), so the parameter
counts are reached once the repository's text (about 1 MB) fills the vocabulary; before
that the models are somewhat smaller.
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
    # about 5M parameters: what the tests and CPU benchmarks run
    "tiny": ModelSize(max_vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=768),
    # about 33-40M: big enough that decode throughput is compute-bound on a CPU
    "small": ModelSize(max_vocab_size=16384, hidden_size=512, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       intermediate_size=2048),
    # Qwen3-0.6B's shape (596M parameters, tied head), random weights: `make device-check`
    "qwen3-0.6b": ModelSize(max_vocab_size=32768, hidden_size=1024, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                            intermediate_size=3072, embedding_rows=151936),
    # `tiny` with an LM head of its own, for tests of sharding such heads
    "tiny-untied": ModelSize(max_vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             intermediate_size=768, tie_word_embeddings=False),
    # Qwen2.5-7B's shape (7.6B parameters, untied head) in the Qwen3 architecture (no q/k/v
    # biases, q/k norms added), for sizing a 7B run
    "qwen2.5-7b": ModelSize(max_vocab_size=32768, hidden_size=3584, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                            intermediate_size=18944, embedding_rows=152064,
                            tie_word_embeddings=False),
}
