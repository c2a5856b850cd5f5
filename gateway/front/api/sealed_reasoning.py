"""Reasoning handed to a scaffold as an opaque string that only this gateway reads back: the
Responses API's `encrypted_content` and the Messages API's omitted-thinking `signature`. The
sealed form is the reasoning text itself, compressed, behind a marker: no secret (the
scaffold already holds the text), only a form read back exactly, so the re-sent turn is the
one recorded. A string the gateway did not seal is a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
import zlib

from undertow.gateway.errors import BadRequest

MARKER = "undertow-reasoning-1:"


def seal(reasoning: str) -> str:
    """The reasoning as an opaque string (`MARKER` + base64url of its zlib)."""
    packed = zlib.compress(reasoning.encode("utf-8", "surrogatepass"))
    return MARKER + base64.urlsafe_b64encode(packed).decode("ascii")


def unseal(sealed: str, param: str) -> str:
    """The reasoning a `seal` string holds; `BadRequest` naming `param` otherwise."""
    if not isinstance(sealed, str) or not sealed.startswith(MARKER):
        raise BadRequest(f"{param}: this encrypted_content was not issued by this gateway "
                         "(it reads only its own); drop it or the reasoning item",
                         param=param)
    try:
        packed = base64.urlsafe_b64decode(sealed[len(MARKER):].encode("ascii"))
        return zlib.decompress(packed).decode("utf-8", "surrogatepass")
    except (binascii.Error, zlib.error, UnicodeError, ValueError):
        raise BadRequest(f"{param}: the encrypted_content is damaged; send it back as the "
                         "gateway returned it", param=param) from None
