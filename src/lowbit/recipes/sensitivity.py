"""How much each linear's quantization under each candidate scheme costs the model's loss.

``sensitivities(model, names, candidates, tokens)`` runs the float model forward and backward on
the calibration tokens (next-token cross-entropy) and, for every linear ``l`` and candidate ``c``,
accumulates the Fisher-weighted output error

    S[l][c] = sum over tokens and output features of (dL/dy_l * (y_l^c - y_l))^2,

where y_l is the float linear's output and y_l^c the output of the same input with the weight
quantized by ``c`` (round to nearest, the scheme's own observer) and the input quantize-dequantized
as ``c`` quantizes activations (static scales from the batch's amax). With a ``valid`` mask
(padded calibration windows) only the real positions count: the loss is the mean over real
next-token targets, the static amax and the sum run over real positions (right padding under
causal attention leaves the real positions' outputs unchanged; a routed MoE expert's rows are
not masked: its padded rows get no gradient, only its amax may see them). To second order, half the
sum over layers of S is the loss increase of quantizing them together (the additive, diagonal
Fisher approximation that NVIDIA ModelOpt's auto_quantize scores layers with). The model's
weights are not changed and get no gradients.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.fusion import shared_weight_global_scales
from lowbit.quant.input_scales import qdq_activation
from lowbit.schemes import Scheme


def quantized_weights(model: nn.Module, names: list[str], scheme: Scheme) -> dict[str, torch.Tensor]:
    """Each linear's weight quantized by ``scheme`` (RTN; fused siblings share NVFP4 global
    scales), dequantized to float32."""
    from lowbit.modules import QuantLinear

    lins = {n: model.get_submodule(n) for n in names}
    gs = shared_weight_global_scales({n: m.weight for n, m in lins.items()}, scheme)
    return {n: QuantLinear.from_linear(m, scheme, name=n, weight_global_scale=gs.get(n)).dequantized_weight()
            for n, m in lins.items()}


def sensitivities(model: nn.Module, names: list[str], candidates: Iterable[Scheme], tokens: torch.Tensor,
                  batch_size: int = 1, valid: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
    """S[name][scheme name] for the linears ``names`` (see the module's docstring), on ``tokens``
    [n, seq_len] in batches of ``batch_size``; ``valid`` [n, seq_len] bool: the positions that
    count (``CalibrationSet.valid``; None: all). ValueError for a mask of another shape."""
    candidates = list(candidates)
    if valid is not None and tuple(valid.shape) != tuple(tokens.shape):
        raise ValueError(f"valid {tuple(valid.shape)} does not match tokens {tuple(tokens.shape)}")
    batch: dict[str, torch.Tensor | None] = {"mask": None}  # the current batch's valid positions
    wq = {c.name: quantized_weights(model, names, c) for c in candidates}
    scores = {n: {c.name: 0.0 for c in candidates} for n in names}
    device = next(model.parameters()).device

    def hook_for(name: str):
        def hook(mod: nn.Linear, args, y: torch.Tensor):
            x = args[0].detach()
            y0 = y.detach().to(torch.float32)
            b = None if mod.bias is None else mod.bias.detach().to(torch.float32)
            mask = batch["mask"]
            if mask is not None and tuple(x.shape[:-1]) != tuple(mask.shape):
                mask = None  # routed MoE expert rows [k, in]: padded rows add no error (their gradient is 0)
            mask = None if mask is None else mask.to(x.device)
            amax = (x if mask is None else x[mask]).abs().amax().to(torch.float32)

            def on_grad(g: torch.Tensor) -> None:
                g32 = g.to(torch.float32)
                with torch.no_grad():
                    for c in candidates:
                        xq = qdq_activation(x, c.input_activations, amax)
                        yq = F.linear(xq.to(torch.float32), wq[c.name][name], b)
                        err = ((yq - y0) * g32).pow(2)
                        if mask is not None:
                            err = err[mask]
                        scores[name][c.name] += float(err.sum())

            if y.requires_grad:
                y.register_hook(on_grad)
        return hook

    emb = model.get_input_embeddings()
    handles = [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in names]
    handles.append(emb.register_forward_hook(lambda m, a, out: out.detach().requires_grad_()))
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        with torch.enable_grad():
            for i in range(0, tokens.shape[0], batch_size):
                ids = tokens[i:i + batch_size].to(device)
                mask = None if valid is None else valid[i:i + batch_size].to(device)
                if mask is not None and not bool(mask[:, 1:].any()):
                    continue  # no real next-token target in these windows
                batch["mask"] = mask
                out = model(input_ids=ids, use_cache=False)
                logits = out.logits[:, :-1].to(torch.float32)
                if mask is None:
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                else:
                    targets = mask[:, 1:].reshape(-1)  # right padding: a real target has a real input
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1])[targets], ids[:, 1:].reshape(-1)[targets])
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, req in flags:
            p.requires_grad_(req)
        model.train(was_training)
    return scores
