"""What the learner reads of a transformers causal LM, declared for the type checker.

`PolicyModel.model` is an `AutoModelForCausalLM` model of one of the supported families
(`model.py`): a decoder (`model.model`: embedding, `layers`, final norm) and an LM head.
`nn.Module.__getattr__` types every such attribute as `Tensor | Module`; these classes
name what each one is. Annotations only: nothing creates them, and nothing checks that
a model is one at run time (`isinstance` would be False for every real model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Decoder(nn.Module):
    """`model.model`: the embedding, the decoder `layers` and the final norm."""

    layers: nn.ModuleList


class CausalLM(nn.Module):
    """A causal LM as transformers builds it. The output embeddings are the LM head: an
    `nn.Linear`, or once sharded a module that keeps its `weight` and `bias`
    (`sharding.py`)."""

    config: PretrainedConfig
    model: Decoder
    lm_head: nn.Module
    get_input_embeddings: Callable[[], nn.Embedding]
    get_output_embeddings: Callable[[], nn.Linear]
    activation_checkpointing_enable: Callable[[dict[str, Any]], None]
    activation_checkpointing_disable: Callable[[], None]
    save_pretrained: Callable[..., None]
