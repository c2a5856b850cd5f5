"""Benchmarks, each run as `python -m benchmarks.<name>`; results go to `benchmarks/results/`."""
