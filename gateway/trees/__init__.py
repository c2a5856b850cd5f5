"""The tree data model, all that the learner imports of the gateway: prefix trees of token
IDs (`tree.py`), their log (`group_log.py`), a cut session's value from its group's tree
(`tree_value.py`), their exception root (`errors.py`) and the chat-template environment
(`template_env.py`). docs/design.md, "Layout".
"""
