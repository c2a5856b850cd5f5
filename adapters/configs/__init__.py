"""Documented configurations of well-known scaffolds, built on the `command` adapter
(`presets.py`), and mini-swe-agent's YAML settings (`mini_swe_agent.yaml`)."""
