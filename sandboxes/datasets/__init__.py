"""Loaders of the SWE datasets people train on: rows from local folders in (nothing is
downloaded), a task set Undertow runs out (`undertow tasks import`; docs/sandboxes.md#datasets).
"""
