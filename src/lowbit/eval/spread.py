"""How much of a perplexity figure is float rounding: the spread under input perturbations.

Quantized activations make a model's output a step function of its input: a change at float32
resolution can flip a rounded code, and with static per-tensor INT8 inputs such flips compound
from layer to layer (on SmolLM2 w8a8-int8, the exact float64 evaluation of a checkpoint and two
float32 ones that order their operations differently land ~0.4% apart, and each moves by ~0.2%
when the input embeddings are perturbed at 1e-7; bench/peers/RESULTS.md). A perplexity difference
smaller than that spread is noise, whichever reader or backend produced it.

``perplexity_spread`` evaluates the model again with its input embeddings multiplied by
``1 + eps * N(0, 1)`` (``eps``: the model dtype's machine epsilon unless given; seeds 0..n-1),
through a forward hook on the embedding module, and returns those perplexities. Models without
quantized activations are smooth at that scale (their spread is ~0) and need no spread.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

#: perturbed evaluations per model with quantized activations (``lowbit eval`` and ``compare``)
DEFAULT_SPREAD_SEEDS = 2


def has_quantized_activations(model: nn.Module) -> bool:
    """Whether any lowbit layer of ``model`` quantizes its input (a scheme's input activations, or a
    GgmlLinear rounding its input to a quantized type as llama.cpp does: ``quantizes_inputs``)."""
    return any(getattr(getattr(m, "scheme", None), "input_activations", None) is not None
               or getattr(m, "quantizes_inputs", False) for m in model.modules())


@contextmanager
def perturbed_embeddings(model: nn.Module, eps: float, seed: int) -> Iterator[None]:
    """Within the block, the input embeddings' outputs are multiplied by ``1 + eps * N(0, 1)``
    (a generator seeded with ``seed``, one draw per forward)."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, out):
        noise = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device, out.dtype)
        return out * (1 + eps * noise)

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def perplexity_spread(model: nn.Module, tokenizer, *, seeds: int = DEFAULT_SPREAD_SEEDS, eps: float | None = None,
                      **perplexity_options) -> list[float]:
    """Perplexities of ``model`` under ``seeds`` perturbations of its input embeddings."""
    from lowbit.eval.perplexity import perplexity

    if eps is None:
        eps = torch.finfo(model.get_input_embeddings().weight.dtype).eps
    out = []
    for seed in range(seeds):
        with perturbed_embeddings(model, eps, seed):
            out.append(perplexity(model, tokenizer, **perplexity_options).perplexity)
    return out


def spread_summary(plain: float, perturbed: list[float]) -> dict:
    """sd and range of ``plain`` with its perturbed values, and the sd as % of ``plain``."""
    vals = [plain, *perturbed]
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"seeds": len(perturbed), "perplexities": perturbed, "sd": sd, "sd_pct": 100.0 * sd / plain,
            "min": min(vals), "max": max(vals)}


def measure_spread(model: nn.Module, tokenizer, plain: float, *, seeds: int, **perplexity_options) -> dict | None:
    """``spread_summary`` of ``plain`` (the unperturbed perplexity) and ``seeds`` perturbed
    evaluations with ``perplexity_options``; None when ``seeds`` is 0 or the model quantizes no
    activations (its spread is ~0). The one rule ``lowbit eval`` and ``lowbit compare`` follow."""
    if seeds <= 0 or not has_quantized_activations(model):
        return None
    return spread_summary(plain, perplexity_spread(model, tokenizer, seeds=seeds, progress=False, **perplexity_options))
