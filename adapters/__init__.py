"""Adapters: launch unmodified scaffolds against a gateway session and a sandbox."""
