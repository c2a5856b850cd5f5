"""Group trees of chat sessions as a real model's gateway records them: every prompt its
chat template rendered and tokenized by its own tokenizer (transformers' `AutoTokenizer`,
independent of the gateway's renderer), each call's prompt the previous prompt plus its
completion plus the newly rendered turns (token truth), and branches where a session
rewrites its history.

The sessions of a group share the system prompt and the task; session 1 repeats session
0's first reply (the same IDs, another owner); session 2 condenses its history after
its second reply (the turns before it dropped, as an agent that summarises does), which
starts a second path of that session at the task's prompt.
"""

from __future__ import annotations

from pathlib import Path

from undertow.gateway.trees.tree import Tree

SYSTEM = "You are a careful Python programmer. Answer with code only."
TASK = "Write a function `add(a, b)` that returns the sum of two integers."
REPLIES = [
    ["def add(a, b):\n    return a + b", "def add(a: int, b: int) -> int:\n    return a + b"],
    ["def add(a, b):\n    return a + b", "def add(a, b):\n    return sum((a, b))"],
    ["def add(x, y):\n    return x + y", "add = lambda a, b: a + b",
     "def add(a, b):\n    \"\"\"The sum.\"\"\"\n    return a + b"],
]
FOLLOW_UPS = ["Add type hints.", "Now make it accept floats too.", "Thanks, that is all."]
REWARDS = [1.0, 0.0, 0.5]


class ChatTreeBuilder:
    """Records chat sessions into one `Tree` from a model directory's tokenizer."""

    def __init__(self, model_dir: Path, group_id: str = "chat"):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tree = Tree(group_id)
        self.end_of_turn = self.tokenizer.eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def record_session(self, session_id: str, replies: list[str], reward: float,
                       condense_after: int | None = None) -> None:
        """One session: a call per reply, the follow-ups between them; after reply
        number `condense_after` the history restarts from the task's prompt."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        prompt_ids = self.encode(self.render(messages))
        for turn, reply in enumerate(replies):
            completion_ids = self.encode(reply) + self.encode(self.end_of_turn)
            logprobs = [-1.0 - 0.01 * (k % 7) for k in range(len(completion_ids))]
            self.tree.add_call(f"{session_id}.{turn}", session_id, prompt_ids, completion_ids,
                               logprobs, [0] * len(completion_ids))
            seen = self.render(messages) + reply + self.end_of_turn
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
            if turn == condense_after:
                messages = [messages[0], {"role": "user", "content": TASK}]
                prompt_ids = self.encode(self.render(messages))
                continue
            rendered = self.render(messages)
            if not rendered.startswith(seen):
                raise ValueError("the template re-renders an earlier turn differently; "
                                 "this builder assumes an append-only template")
            prompt_ids = prompt_ids + completion_ids + self.encode(rendered[len(seen):])
        self.tree.close_session(session_id, reward)


def build_chat_tree(model_dir: Path, group_id: str = "chat") -> Tree:
    """The group of the module docstring."""
    builder = ChatTreeBuilder(model_dir, group_id)
    for index, (replies, reward) in enumerate(zip(REPLIES, REWARDS, strict=True)):
        builder.record_session(f"s{index}", replies, reward,
                               condense_after=1 if index == 2 else None)
    return builder.tree
