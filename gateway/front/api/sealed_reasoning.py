"""Reasoning handed to a scaffold as an opaque string that only this gateway reads back.

The Responses API's `include: ["reasoning.encrypted_content"]` asks for each reasoning
item's reasoning as `encrypted_content`, which a stateless scaffold (Codex, `store:
false`) sends back with its history so that the next call can show the model its earlier
reasoning even when the readable summary is dropped; the Messages API's `thinking.display:
"omitted"` carries omitted thinking the same way, in a thinking block's `signature`. The
gateway's sealed form is the reasoning text itself, compressed, behind a marker: not a
secret (the scaffold is the user's own program and already holds the text), only a form
the gateway can recognise and read back exactly. Read back, it is the very
`reasoning_content` the gateway returned, so the re-sent assistant turn is the one
recorded and token truth holds as with the summary.

A sealed string from anything else (another provider's ciphertext, a damaged one) is a
400 naming the field: the gateway cannot read it, and dropping it would be silence.
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
