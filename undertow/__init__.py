"""Undertow: elastic reinforcement learning for long-horizon software-engineering agents.

This package is the composition root only: the command line (`cli.py`), the run
configuration (`config.py`) and the wiring of one run. The parts live in
`undertow.gateway`, `undertow.sandboxes`, `undertow.adapters` and `undertow.learner`.
"""

__version__ = "0.1.0"
