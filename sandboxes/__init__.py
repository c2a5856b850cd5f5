"""Sandboxes: SWE tasks, their Docker images and containers, and grading by tests.

This package imports nothing: import its modules directly. The module map, and how the
pieces fit: docs/sandboxes.md.
"""
