"""A model built from its config on the meta device: structure and forward without memory or weights.

Model-free and loading code read what a model *is* (its fused-expert layouts, what its forward sets
apart, whether its first forward writes its weights) from the model transformers builds for a
config, without reading a checkpoint: ``meta_model(config)`` builds it with every parameter and
buffer on the meta device, in evaluation mode, transformers' remarks on the config silenced.
"""

from __future__ import annotations

import warnings

import torch.nn as nn


def meta_model(config) -> nn.Module:
    """The causal LM transformers builds for ``config`` (a ``PretrainedConfig``), parameters and
    buffers on the meta device, eval mode. Raises whatever transformers raises for a config it
    cannot build (callers that can do without the model catch it)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_empty_weights(include_buffers=True):
            return AutoModelForCausalLM.from_config(config).eval()
