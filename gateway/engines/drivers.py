"""Which driver speaks to an engine, chosen by the scheme of its URL.

`http://host:port` (or `sglang+http://...`) is an SGLang-protocol engine (SGLang or
the built-in engine): `SGLangDriver`. `vllm+http://host:port` is a vLLM server:
`VLLMDriver` on `http://host:port`. The pool keeps the URL as given, so the kind of
each engine stays visible in `/admin/engines`; the same URLs work for
`undertow gateway serve --engine` and `POST /admin/engines`.
"""

from __future__ import annotations

from collections.abc import Callable

from undertow.gateway.engines.protocol import EngineDriver
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.engines.vllm import VLLMDriver

DRIVERS: dict[str, Callable[[str], EngineDriver]] = {"sglang": SGLangDriver,
                                                   "vllm": VLLMDriver}


def driver_for_url(url: str) -> EngineDriver:
    """The driver for `url` (see the module docstring); an unknown `kind+` prefix is a
    `ValueError` naming the kinds there are."""
    scheme, separator, rest = url.partition("://")
    kind, _, transport = scheme.rpartition("+") if "+" in scheme else ("sglang", "", scheme)
    if not separator or kind not in DRIVERS:
        raise ValueError(f"engine URL {url!r}: give http://host:port or KIND+http://host:port "
                         f"with KIND one of {sorted(DRIVERS)}")
    return DRIVERS[kind](f"{transport}://{rest}")
