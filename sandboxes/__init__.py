"""Sandboxes: SWE tasks, their Docker images and containers, and grading by tests."""
