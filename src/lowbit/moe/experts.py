"""One linear per expert projection, and the routed block of experts they form.

``ExpertMLP`` is one expert: ``down_proj(gate(gate_proj(x), up_proj(x)))``, where the gate
function is a ``GateKind``:

- ACT_MUL: ``act(g) * u`` (Llama-style SwiGLU and its kin; transformers' default gating);
- CLAMPED_SWIGLU: gpt-oss's ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with
  ``g' = clamp(g, max=limit)``;
- ACT: ``act(u)``, experts without a gate projection (``gate_proj`` is None);
- OWN: the fused module's own ``_apply_gate`` (clamped SwiGLUs of DeepSeek-V4, Hunyuan-V4,
  MiniMax-M3 ...), called on ``[gate | up]`` re-assembled in the fused layout.

``SplitExperts`` holds experts ``0`` .. ``E-1`` as children (so their linears are named
``experts.{e}.gate_proj`` ...) and is called like transformers' fused experts module: with the
block's hidden states [T, H], the top-k expert indices [T, k] and their weights [T, k]; it returns
sum_k weight_k * expert_{index_k}(x) per token, looping over the experts that at least one token
is routed to. With ``route_all_tokens`` set (``lowbit.moe.all_tokens``), every expert runs on every
token (so that observers on its linears see them all); the output still uses the routed rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
import torch.nn as nn


class GateKind(str, Enum):
    ACT_MUL = "act_mul"
    CLAMPED_SWIGLU = "clamped_swiglu"
    ACT = "act"
    OWN = "own"  # the fused module's own ``_apply_gate`` on the re-assembled gate_up output

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Gate:
    """The expert's gating: its kind, the activation (ACT_MUL, ACT) or gpt-oss's constants."""

    kind: GateKind
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    alpha: float = 0.0
    limit: float = 0.0
    own: Callable[[torch.Tensor], torch.Tensor] | None = None  # OWN: gate_up [.., 2I] -> [.., I]
    concatenated: bool = True  # OWN: gate_up holds [gate | up] (False: g0, u0, g1, u1, ...)

    def __call__(self, g: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
        if self.kind is GateKind.ACT:
            return self.act(u)
        if self.kind is GateKind.ACT_MUL:
            return self.act(g) * u
        if self.kind is GateKind.OWN:
            gate_up = torch.cat([g, u], -1) if self.concatenated else torch.stack([g, u], -1).flatten(-2)
            return self.own(gate_up)
        g = g.clamp(min=None, max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


class ExpertMLP(nn.Module):
    """One expert: gate_proj (None without a gate), up_proj, down_proj."""

    def __init__(self, gate_proj: nn.Module | None, up_proj: nn.Module, down_proj: nn.Module, gate: Gate) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x) if self.gate_proj is not None else None
        return self.down_proj(self.gate(g, self.up_proj(x)))


class ExpertList(nn.Module):
    """Experts as ``ExpertMLP`` children ``0`` .. ``E-1`` (so their linears are named
    ``experts.{e}.gate_proj`` ...); subclasses say how a call reaches them."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__()
        for e, m in enumerate(experts):
            self.add_module(str(e), m)
        self.num_experts = len(experts)

    def __getitem__(self, e: int) -> ExpertMLP:
        return self._modules[str(e)]

    def __len__(self) -> int:
        return self.num_experts


class SplitExperts(ExpertList):
    """A block's routed experts; see the module docstring."""

    def __init__(self, experts: list[ExpertMLP], layout=None) -> None:
        super().__init__(experts)
        self.route_all_tokens = False
        self.layout = layout  # the FusedLayout they were split from (a reader of fused checkpoints' key), or None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        index = top_k_index if top_k_index is not None else router_indices
        weights = top_k_weights if top_k_weights is not None else routing_weights
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [E + 1, k, T]: column E takes the expert-parallel sentinel (an index == E), never run
            mask = nn.functional.one_hot(index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().reshape(-1).tolist()
        hit = [e for e in hit if e < self.num_experts]
        for e in (range(self.num_experts) if self.route_all_tokens else hit):
            pos, tok = torch.where(mask[e])
            if self.route_all_tokens:
                y = self[e](hidden_states)[tok]
            elif tok.numel():
                y = self[e](hidden_states[tok])
            else:
                continue
            if tok.numel():
                y = y * weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out
