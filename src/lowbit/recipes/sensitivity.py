"""How much each linear's quantization under each candidate scheme costs the model's loss.

``sensitivities(model, names, candidates, tokens)`` runs the float model forward and backward on
the calibration tokens (next-token cross-entropy) and, for every linear ``l`` and candidate ``c``,
accumulates the Fisher-weighted output error

    S[l][c] = mean over batches b of  N_b * sum over b's tokens and output features of
              (dL_b/dy_l * (y_l^c - y_l))^2,

where y_l is the float linear's output and y_l^c the output of the same input with the weight
quantized by ``c`` (the weights given, ``lowbit.recipes.rounded.calibrated_weights``: GPTQ's for the
candidates calibrated with it; else round to nearest with the scheme's own observer) and the input quantize-dequantized
as ``c`` quantizes activations (static scales from the batch's amax). With a ``valid`` mask
(padded calibration windows) only the real positions count: the loss is the mean over real
next-token targets, the static amax and the sum run over real positions (right padding under
causal attention leaves the real positions' outputs unchanged; a routed MoE expert's rows are
not masked: its padded rows get no gradient, only its amax may see them). To second order, half the
sum over layers of S is the increase of the mean next-token loss, in nats, of quantizing them
together (the additive, diagonal Fisher approximation that NVIDIA ModelOpt's auto_quantize scores
layers with). L_b is batch b's mean loss over its N_b real targets: its gradient is 1/N_b of the
summed loss's, whose squared gradient is the batch's empirical Fisher; hence the factor N_b, which
makes S a per-token figure, the same for one window or many. The model's
weights are not changed and get no gradients.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.quant.input_scales import qdq_activation
from lowbit.recipes.rounded import quantized_weights
from lowbit.schemes import Scheme


def window_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean next-token cross-entropy of ``ids`` [b, seq_len] over the real targets (``mask``
    [b, seq_len] of real positions, right padding; None: all)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].to(torch.float32)
    flat, targets = logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    if mask is None:
        return F.cross_entropy(flat, targets)
    real = mask[:, 1:].reshape(-1)  # right padding: a real target has a real input
    return F.cross_entropy(flat[real], targets[real])


def sensitivities(model: nn.Module, names: list[str], candidates: Iterable[Scheme], tokens: torch.Tensor,
                  batch_size: int = 1, valid: torch.Tensor | None = None,
                  weights: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, dict[str, float]]:
    """S[name][scheme name] for the linears ``names`` (see the module's docstring), on ``tokens``
    [n, seq_len] in batches of ``batch_size``; ``valid`` [n, seq_len] bool: the positions that
    count (``CalibrationSet.valid``; None: all); ``weights``: per candidate name, each linear's
    quantized weight (float32 [out, in]); a candidate left out is rounded to nearest. ValueError
    for a mask of another shape."""
    candidates = list(candidates)
    if valid is not None and tuple(valid.shape) != tuple(tokens.shape):
        raise ValueError(f"valid {tuple(valid.shape)} does not match tokens {tuple(tokens.shape)}")
    batch: dict = {"mask": None, "targets": 0}  # the current batch's valid positions and target count
    given = weights or {}
    wq = {c.name: given[c.name] if c.name in given else quantized_weights(model, names, c) for c in candidates}
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
                        scores[name][c.name] += batch["targets"] * float(err.sum())

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
        batches = 0
        with torch.enable_grad():
            for i in range(0, tokens.shape[0], batch_size):
                ids = tokens[i:i + batch_size].to(device)
                mask = None if valid is None else valid[i:i + batch_size].to(device)
                if mask is not None and not bool(mask[:, 1:].any()):
                    continue  # no real next-token target in these windows
                batch["mask"] = mask
                batch["targets"] = ids[:, 1:].numel() if mask is None else int(mask[:, 1:].sum())
                window_loss(model, ids, mask).backward()
                batches += 1
    finally:
        for h in handles:
            h.remove()
        for p, req in flags:
            p.requires_grad_(req)
        model.train(was_training)
    return {n: {c: v / max(1, batches) for c, v in per.items()} for n, per in scores.items()}
