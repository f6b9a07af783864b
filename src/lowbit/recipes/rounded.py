"""The quantized weights the sensitivities are measured with (``lowbit.recipes.sensitivity``).

``quantized_weights``: round to nearest with the scheme's own observer (fused siblings share
NVFP4 global scales).

``calibrated_weights``: what ``lowbit.quantize``'s calibration would round each weight to, as far
as it can be known before quantizing: for a candidate the quantization rounds with GPTQ
(``CalibrationConfig.rounding_for``), GPTQ's weights solved on the float model's input Hessians
(one per fused group, as the pipeline shares it) over the measured windows, with the options
the quantization uses (``CalibrationConfig.gptq_options``); round to nearest for the others. The
quantization later solves GPTQ again on the partly quantized model's inputs and may reconstruct
after it: these weights estimate its error better than round to nearest does (GPTQ removes most
of a 4-bit weight's output error and none of its input quantization's), they are not its result.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from lowbit.fusion import fused_groups, shared_weight_global_scales
from lowbit.schemes import Scheme


def quantized_weights(model: nn.Module, names: list[str], scheme: Scheme) -> dict[str, torch.Tensor]:
    """Each linear's weight quantized by ``scheme`` (RTN; fused siblings share NVFP4 global
    scales), dequantized to float32."""
    from lowbit.modules import QuantLinear

    lins = {n: model.get_submodule(n) for n in names}
    gs = shared_weight_global_scales({n: m.weight for n, m in lins.items()}, scheme)
    return {n: QuantLinear.from_linear(m, scheme, name=n, weight_global_scale=gs.get(n)).dequantized_weight()
            for n, m in lins.items()}


def input_hessians(model: nn.Module, groups: list[list[str]], tokens: torch.Tensor,
                   valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The float model's input Hessian (sum of x^T x, float64, upper triangle) of every fused
    group's shared input, keyed by the group's first linear, over ``tokens`` [n, seq_len] one
    window at a time; ``valid`` [n, seq_len]: the positions that count (a routed expert's rows
    all count). A linear that never sees an input (an expert no token reached) has no entry."""
    from lowbit.calibration.capture import observing
    from lowbit.calibration.hessian import HessianSum

    sums = {g[0]: HessianSum() for g in groups}
    window: dict = {"mask": None}
    device = next(model.parameters()).device

    def add(name: str, x: torch.Tensor) -> None:
        mask = window["mask"]
        if mask is not None and tuple(x.shape[:-1]) == tuple(mask.shape):
            x = x[mask]
        if x.numel():
            sums[name].add(x)

    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), observing({n: model.get_submodule(n) for n in sums}, add):
            for i in range(tokens.shape[0]):
                window["mask"] = None if valid is None else valid[i:i + 1].to(device)
                model(input_ids=tokens[i:i + 1].to(device), use_cache=False)
    finally:
        model.train(was_training)
    return {n: s.upper() for n, s in sums.items() if s.upper() is not None}


def calibrated_weights(model: nn.Module, names: list[str], candidates: list[Scheme], tokens: torch.Tensor,
                       valid: torch.Tensor | None, config) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Per candidate name, each linear's weight as the candidate's calibration would round it
    (see the module), dequantized to float32; and per candidate, the rounding used ("gptq" or
    "rtn"). ``config``: the ``CalibrationConfig`` the quantization will use. A linear of a GPTQ
    candidate without a Hessian (an expert no token reached) is rounded to nearest."""
    from lowbit.algorithms.gptq import WeightRounding, gptq_quantize_groups
    from lowbit.modules import QuantLinear
    from lowbit.threads import one_thread

    roundings = {c.name: config.rounding_for(c) for c in candidates}
    gptq = [c for c in candidates if roundings[c.name] is WeightRounding.GPTQ]
    out = {c.name: {} if c in gptq else quantized_weights(model, names, c) for c in candidates}
    if gptq:
        groups = fused_groups(names)
        hessians = input_hessians(model, groups, tokens, valid)
        solvable = [g for g in groups if g[0] in hessians]
        chunks: dict[str, list[list[str]]] = defaultdict(list)  # a block's groups at once: bounded memory
        for g in solvable:
            chunks[g[0].rsplit(".", 2)[0]].append(g)
        cores = torch.get_num_threads()
        weights = {n: model.get_submodule(n).weight for n in names}
        for c in gptq:
            gs = shared_weight_global_scales(weights, c)
            for chunk in chunks.values():
                with one_thread():
                    qts = gptq_quantize_groups([[weights[n] for n in g] for g in chunk],
                                               [hessians[g[0]] for g in chunk], c.weights,
                                               global_scales=[[gs.get(n) for n in g] for g in chunk],
                                               options=config.gptq_options(c),
                                               names=[[f"{n}.weight" for n in g] for g in chunk], workers=cores)
                for g, group_qts in zip(chunk, qts):
                    for n, qt in zip(g, group_qts):
                        out[c.name][n] = QuantLinear.from_quantized(qt, c, name=n).dequantized_weight()
        del hessians
        for c in gptq:  # no Hessian (an expert no token reached): round to nearest
            left = [n for n in names if n not in out[c.name]]
            if left:
                out[c.name].update(quantized_weights(model, left, c))
    return out, {k: v.value for k, v in roundings.items()}
