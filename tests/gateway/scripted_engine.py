"""The scripted engine the gateway, adapter and benchmark tests use; it ships in the
package (`undertow.gateway.engines.scripted`) because `undertow sft-collect` serves it."""

from undertow.gateway.engines.scripted import WEIGHT_VERSION, ScriptedEngine, Sent

__all__ = ["WEIGHT_VERSION", "ScriptedEngine", "Sent"]
