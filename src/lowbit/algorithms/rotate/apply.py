"""``rotate_model``: fuse Hadamard rotations into a float Hugging Face causal LM, in place.

Steps (``lowbit.algorithms.rotate.ops`` for the algebra, ``layout`` for which module is which, read
from the model's data flow):
1. a tied lm_head is untied (it is the embedding times the final norm's gain, rotated), and
   ``config.tie_word_embeddings`` becomes False, so every saver writes ``lm_head.weight``;
2. every norm that reads the stream has its gain folded into the linears (and MoE routers) it feeds,
   and the gain becomes the identity (1; 0 for Gemma's (1 + w) norms), the final norm's into lm_head;
3. R1: the residual stream is rotated by Q = ``hadamard(hidden)`` (block-diagonal when the width is
   not a constructible order: ``block_hadamard``): embeddings E <- E Q, readers W <- W Q (lm_head
   too), writers (o_proj, down_proj, every expert's down_proj, ...) W <- Q^T W, b <- b Q;
4. R2: per attention head, H = ``hadamard(head_dim)`` on each v -> o pair's v rows and o columns
   (head_dim: the width attention saw; layers without such a pair get R1 only).

The result is an ordinary float model (no new modules, no hooks) computing the same logits up to
float rounding, so every format saves it as any other checkpoint. Online rotations (a Hadamard
applied to down_proj's input at run time, QuaRot's R4) are left out: they need compressed-tensors'
``transform_config`` in the checkpoint, which transformers 5.24 does not apply on load, so the
stock loader would compute a different model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.algorithms.rotate.hadamard import block_hadamard, block_size
from lowbit.algorithms.rotate.layout import NormReaders, residual_layout
from lowbit.algorithms.rotate.ops import (
    fold_gain, rotate_bias, rotate_head_bias, rotate_head_inputs, rotate_head_outputs, rotate_inputs, rotate_outputs,
)
from lowbit.algorithms.rotate.options import Rotation, RotationReport
from lowbit.algorithms.smoothquant.mappings import SourceKind


def _set(mod: nn.Module, attr: str, value: torch.Tensor) -> None:
    """Give ``mod`` a new parameter ``attr`` (never writing into a tensor another module shares)."""
    old = getattr(mod, attr)
    setattr(mod, attr, nn.Parameter(value.to(old.device), requires_grad=old.requires_grad))


def _fold_norm(model: nn.Module, nr: NormReaders) -> None:
    norm = model.get_submodule(nr.norm)
    g = norm.weight.detach().double()
    gain = g + 1.0 if nr.kind is SourceKind.RMS_ONE_PLUS else g
    for r in nr.readers:
        lin = model.get_submodule(r)
        _set(lin, "weight", fold_gain(lin.weight.detach(), gain))
    unit = torch.zeros_like(norm.weight) if nr.kind is SourceKind.RMS_ONE_PLUS else torch.ones_like(norm.weight)
    _set(norm, "weight", unit)


def _untie(model: nn.Module) -> bool:
    """Whether the output embedding shared the input embedding's weight; it no longer does."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr()
    if tied:
        _set(head, "weight", head.weight.detach().clone())
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    return tied


def _r1(model: nn.Module, layout, q: torch.Tensor) -> None:
    for e in layout.embeddings:
        emb = model.get_submodule(e)
        _set(emb, "weight", rotate_inputs(emb.weight.detach(), q))
    readers = dict.fromkeys([r for n in layout.norms for r in n.readers] + list(layout.readers))
    for r in readers:
        m = model.get_submodule(r)
        _set(m, "weight", rotate_inputs(m.weight.detach(), q))
    for w in layout.writers:
        m = model.get_submodule(w)
        _set(m, "weight", rotate_outputs(m.weight.detach(), q))
        if getattr(m, "bias", None) is not None:
            _set(m, "bias", rotate_bias(m.bias.detach(), q))


def _r2(model: nn.Module, layout) -> None:
    dev = model.get_input_embeddings().weight.device
    for p in layout.pairs:
        h = block_hadamard(p.head_dim).to(dev)
        v, o = model.get_submodule(p.v_proj), model.get_submodule(p.o_proj)
        _set(v, "weight", rotate_head_outputs(v.weight.detach(), h))
        if getattr(v, "bias", None) is not None:
            _set(v, "bias", rotate_head_bias(v.bias.detach(), h))
        _set(o, "weight", rotate_head_inputs(o.weight.detach(), h))


@torch.no_grad()
def rotate_model(model: nn.Module, rotation: Rotation | str) -> RotationReport | None:
    """Fuse ``rotation`` into the float ``model`` in place (module docstring); returns what was done
    (None for ``Rotation.NONE``). The model must not be quantized yet. A model the fused rotation
    cannot handle exactly is a QuantizationError naming its class and the module, before any
    weight changes."""
    try:
        rotation = Rotation(rotation)
    except ValueError:
        raise QuantizationError(f"unknown rotation {rotation!r}; known: {', '.join(r.value for r in Rotation)}") \
            from None
    if rotation is Rotation.NONE:
        return None
    from lowbit.moe import split_experts

    split_experts(model)  # Conv1D stays: the layout refuses those families before any weight changes
    layout = residual_layout(model)
    odd = [w for w in [layout.hidden] + [p.head_dim for p in layout.pairs] if block_size(w) == 1]
    if odd:
        raise QuantizationError(f"rotation {rotation.value!r}: {type(model).__name__}'s width {odd[0]} is odd, so no "
                                f"Hadamard block (order >= 2) divides it")
    q = block_hadamard(layout.hidden).to(model.get_input_embeddings().weight.device)
    untied = _untie(model)
    for n in layout.norms:
        _fold_norm(model, n)
    _r1(model, layout, q)
    _r2(model, layout)
    head_dim = layout.pairs[0].head_dim if layout.pairs else 0
    return RotationReport(rotation.value, layout.hidden, block_size(layout.hidden), head_dim,
                          block_size(head_dim) if head_dim else 0, layout.layers, untied, len(layout.pairs))
