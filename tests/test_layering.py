"""The import edges of DESIGN.md ("Layout"), checked in fresh processes."""

import functools
import json
import subprocess
import sys

import pytest

PROBE = """
import importlib, json, sys
importlib.import_module({module!r})
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'undertow'))))
"""

# package -> module prefixes it must never import
FORBIDDEN = {
    "undertow.gateway": ["torch", "undertow.learner", "undertow.sandboxes", "undertow.adapters"],
    "undertow.sandboxes": ["torch", "undertow.gateway", "undertow.learner", "undertow.adapters"],
    "undertow.adapters": ["torch", "undertow.learner"],
    "undertow.learner": ["undertow.sandboxes", "undertow.adapters"],
}


def _all_modules(package: str) -> list[str]:
    import pkgutil

    root = __import__(package, fromlist=["_"])
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        names.append(info.name)
    return names


@functools.cache
def _imported_by(module: str) -> list[str]:
    """Modules imported by importing `module` in a fresh process (cached: one process each)."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Only the built-in engine's torch modules may import torch inside the gateway.
TORCH_ALLOWED = ("undertow.gateway.engines.builtin.",)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_import_edges(package):
    for module in _all_modules(package):
        if module.startswith(TORCH_ALLOWED) or "__main__" in module:
            continue
        imported = _imported_by(module)
        for prefix in FORBIDDEN[package]:
            if package == "undertow.learner" and prefix == "undertow.gateway":
                continue
            bad = [m for m in imported if m == prefix or m.startswith(prefix + ".")]
            assert not bad, f"{module} imports {bad[:3]}, which DESIGN.md forbids"


def test_learner_uses_only_the_gateway_tree_model():
    for module in _all_modules("undertow.learner"):
        imported = _imported_by(module)
        gateway = [m for m in imported if m.startswith("undertow.gateway.")
                   and m not in ("undertow.gateway.tree",)]
        assert not gateway, f"{module} imports gateway internals {gateway[:3]}"


@pytest.mark.parametrize("package", ["undertow.gateway", "undertow.sandboxes",
                                     "undertow.adapters"])
def test_package_root_does_not_import_torch(package):
    assert not [m for m in _imported_by(package) if m.split(".")[0] == "torch"]
