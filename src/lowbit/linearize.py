"""Every matmul weight a decoder holds outside ``nn.Linear``, made an ``nn.Linear`` computing the same.

- Fused MoE experts (transformers' 3-D ``gate_up_proj`` / ``down_proj``): split per expert
  (``lowbit.moe.split_experts``).
- A linear applied per input group (DeepSeek-V4's ``o_a_proj``: row block g times head group g):
  one linear per group (``lowbit.moe.row_groups``, run by ``split_experts``).
- transformers' ``Conv1D`` (GPT-2, GPT-BigCode's kin, OpenAI GPT): a linear whose weight is stored
  [in, out] and applied as ``addmm(bias, x, W)``; it becomes ``nn.Linear`` with the weight
  transposed ([out, in], a contiguous copy) and the same bias, so ``F.linear(x, W^T, b)`` computes
  the same products (the float sums may be ordered otherwise). Recognised by its type.

``linearize`` is what ``quantize``, ``load``, ``compare`` and ``auto_recipe`` run before they list
the linears (the streamed skeleton runs its two steps itself, reading Conv1D weights transposed),
so the names and shapes are the same everywhere. Idempotent.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.moe import split_experts
from lowbit.targets import set_submodule


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # a transformers without it has no such modules
        return None
    return Conv1D


@torch.no_grad()
def conv1d_as_linears(model: nn.Module) -> list[str]:
    """Replace every transformers ``Conv1D`` of ``model`` by the ``nn.Linear`` it is (module
    docstring); returns their names, in model order."""
    conv1d = _conv1d_type()
    if conv1d is None:
        return []
    names = [n for n, m in model.named_modules() if isinstance(m, conv1d)]
    for name in names:
        old = model.get_submodule(name)
        w = old.weight.detach()
        lin = nn.Linear(w.shape[0], w.shape[1], bias=old.bias is not None, device="meta")
        lin.weight = nn.Parameter(w.t().contiguous(), requires_grad=False)
        if old.bias is not None:
            lin.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
        set_submodule(model, name, lin)
    return names


def linearize(model: nn.Module) -> list[str]:
    """Fused experts split and ``Conv1D`` modules made linears, in place; returns the names of the
    replaced modules."""
    return split_experts(model) + conv1d_as_linears(model)
