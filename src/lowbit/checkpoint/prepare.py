"""Models that prepare their own weights in place in their first forward, prepared before a
checkpoint is read into them.

RWKV rescales its blocks' ``attention.output`` and ``feed_forward.value`` weights by powers of two
in its first evaluation forward (``weight.div_``) and records that it did (``layers_are_rescaled``),
so that the forwards after it read the prepared weights. A model lowbit quantized in memory ran
that first forward before its weights were quantized (the target survey's forward,
``lowbit.targets.survey_weights``), so its checkpoint holds the prepared weights; a model rebuilt
from its config would prepare them again at its first forward, which fails on a lowbit layer
(it has codes, not a ``weight``: an ``AttributeError``) and would rescale a float one twice.

Which models do so is read from the model, not from a table of families: a copy built from the
same config on the meta device (no memory, no weights) runs one forward on two tokens, and a
parameter whose version counter moved was written in place by it (``prepares_in_forward``). Such a
model runs that first forward on its empty float weights before the checkpoint is read in
(``prepare``): what it writes is then overwritten by the stored, already prepared, tensors, and
the model's own state says they are prepared. A model whose forward cannot run on the meta device
is taken not to prepare anything.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn


def _two_tokens(device) -> torch.Tensor:
    return torch.ones(1, 2, dtype=torch.long, device=device)


def prepares_in_forward(config) -> bool:
    """Whether the model ``config`` describes writes any of its parameters in place during its
    first forward in evaluation mode (module docstring)."""
    try:
        from lowbit.meta_model import meta_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = meta_model(config)
            before = {n: p._version for n, p in meta.named_parameters(remove_duplicate=False)}
            with torch.no_grad():
                meta(input_ids=_two_tokens("meta"), use_cache=False)
    except Exception:  # noqa: BLE001 - a forward the meta device cannot run: nothing is known to be prepared
        return False
    return any(p._version != before[n] for n, p in meta.named_parameters(remove_duplicate=False))


@torch.no_grad()
def prepare(model: nn.Module) -> bool:
    """Run ``model``'s first forward (on two tokens, where its first parameter is) when the model
    prepares its weights in it (``prepares_in_forward``); returns whether it ran. Call it on the
    float model built from the config, before its linears are replaced and its tensors loaded."""
    if not prepares_in_forward(model.config):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=_two_tokens(next(model.parameters()).device), use_cache=False)
    return True
