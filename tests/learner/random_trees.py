"""Random group trees built through the real `Tree.add_call`, with token truth (each
call's prompt is the previous prompt plus the completion plus new tokens) and
history rewrites that branch a session, for the learner's tests and benchmark."""

import random

from undertow.gateway.trees.tree import Tree

VOCAB = 6000


def _tokens(rng: random.Random, num: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(num)]


def build_random_tree(seed: int, group_id: str = "g", num_sessions: int = 3, num_turns: int = 4,
                      prefix_len: int = 10, rewrite_prob: float = 0.4) -> Tree:
    """A group tree: sessions share a prefix; each turn samples 1-6 tokens and adds an
    observation; a rewrite cuts the history at a random point (possibly inside a
    completion, so branches share sampled tokens) and continues with new tokens.
    Session 1 repeats session 0's first completion (same IDs, another owner)."""
    rng = random.Random(seed)
    tree = Tree(group_id)
    prefix = _tokens(rng, prefix_len)
    first_completion = None
    for index in range(num_sessions):
        session_id = f"s{index}"
        history = prefix + _tokens(rng, rng.randrange(0, 3))
        for turn in range(num_turns):
            if turn and rng.random() < rewrite_prob:
                cut = rng.randrange(prefix_len, len(history))
                history = history[:cut] + _tokens(rng, rng.randrange(1, 4))
            completion = _tokens(rng, rng.randrange(1, 7))
            if turn == 0 and index == 1 and first_completion is not None:
                completion = list(first_completion)
            first_completion = first_completion or completion
            logprobs = [rng.uniform(-9.6, -8.2) for _ in completion]
            tree.add_call(f"{session_id}-{turn}", session_id, history, completion, logprobs,
                          [0] * len(completion))
            history = history + completion + _tokens(rng, rng.randrange(1, 5))
        tree.close_session(session_id, reward=rng.choice([0.0, 0.25, 1.0]))
    return tree
