"""A linear whose row blocks each multiply their own group of the input, split into one
``nn.Linear`` per group.

DeepSeek-V4's grouped output projection (``self_attn.o_a_proj``) is an ``nn.Linear`` subclass
holding ``weight`` [G * r, in] and called on ``x`` [..., G, in]: group g of the input is multiplied
by rows ``g*r .. (g+1)*r - 1`` only (a block-diagonal matrix, through ``bmm``), and the output is
[..., G, r]. Quantized as a plain linear it would compute something else, so it is recognised
from the module itself, not from its name or class: an ``nn.Linear`` whose forward is not
``F.linear`` (``lowbit.targets.is_plain_linear``) and whose forward, on a copy holding seeded
random values (the module's own weight may not be loaded yet), equals the block-diagonal product
for some G dividing its rows (``_matches``). The candidates are the module's own integer
attributes that divide its rows (``n_groups``), then every divisor up to 64. No candidate: it
stays what it was (a matmul weight outside a linear, refused by name,
``lowbit.targets.unquantizable_targets``).

``RowGroupLinears`` holds group g's linear as child ``g`` (``self_attn.o_a_proj.{g}``, quantized,
calibrated on its own group's inputs and saved like any linear) and is called like the module it
replaces. A checkpoint holds the module's ``<module>.weight`` whole: group g is its row block g
(``FusedLayout(row_groups=G)``, ``lowbit.moe.slices.expert_part``), read so by the streamed
skeleton and model-free quantization.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from lowbit.moe.slices import FusedLayout, Proj, expert_part
from lowbit.targets import is_plain_linear, probe_key

#: largest group count tried beyond the module's own integer attributes
MAX_GROUPS = 64


class RowGroupLinears(nn.Module):
    """Linears ``0`` .. ``G-1``, linear g applied to ``x[..., g, :]`` (module docstring); ``layout``
    says how a checkpoint of the replaced module holds them (``<module>.weight`` row blocks)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        for g, lin in enumerate(linears):
            self.add_module(str(g), lin)
        self.num_groups = len(linears)
        self.layout = FusedLayout(row_groups=len(linears))

    def __getitem__(self, g: int) -> nn.Module:
        return self._modules[str(g)]

    def __len__(self) -> int:
        return self.num_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] != self.num_groups:
            raise ValueError(f"RowGroupLinears of {self.num_groups} groups called on an input of shape {tuple(x.shape)}")
        return torch.stack([self[g](x[..., g, :]) for g in range(self.num_groups)], dim=-2)


#: memo of ``row_groups``: (class, in, out, bias, plain attributes) -> G or 0 (the probe is a pure
#: function of these: its weights are seeded random)
_GROUPS: dict[tuple, int] = {}


def row_groups(module: nn.Module) -> int:
    """G when ``module`` is a linear applying its row blocks to G input groups (module docstring),
    else 0."""
    if not isinstance(module, nn.Linear) or is_plain_linear(module):
        return 0
    key = probe_key(module, module.in_features, module.out_features, module.bias is None)
    if key not in _GROUPS:
        _GROUPS[key] = _find_groups(module, key[2])
    return _GROUPS[key]


def _find_groups(module: nn.Linear, attrs: tuple) -> int:
    rows = module.out_features
    own = [v for _, v in attrs if isinstance(v, int) and not isinstance(v, bool) and 1 < v <= rows and rows % v == 0]
    for g in dict.fromkeys(own + [d for d in range(2, min(rows, MAX_GROUPS) + 1) if rows % d == 0]):
        if _matches(module, g):
            return g
    return 0


@torch.no_grad()
def _matches(module: nn.Linear, groups: int) -> bool:
    """Whether ``module``'s forward, on a copy holding seeded random values, computes the
    block-diagonal product of ``groups`` groups on an input [2, groups, in]."""
    gen = torch.Generator().manual_seed(0)
    probe = copy.copy(module)  # shallow: new parameter and buffer tables, the module's tensors untouched
    probe._parameters = {k: None if p is None else nn.Parameter(torch.randn(p.shape, generator=gen),
                                                                 requires_grad=False)
                         for k, p in module._parameters.items()}
    probe._buffers = {k: None if b is None else torch.zeros(b.shape, dtype=b.dtype) for k, b in module._buffers.items()}
    x = torch.randn(2, groups, module.in_features, generator=gen)
    try:
        got = probe(x)
    except Exception:  # noqa: BLE001 - a forward that cannot take this grouping is not of it
        return False
    want = _split(probe, groups)(x)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _split(module: nn.Linear, groups: int) -> RowGroupLinears:
    layout = FusedLayout(row_groups=groups)
    w = module.weight.detach()
    b = None if module.bias is None else module.bias.detach()
    out = []
    for g in range(groups):
        wg = expert_part(w, g, Proj.DOWN, layout)
        lin = nn.Linear(wg.shape[1], wg.shape[0], bias=b is not None, device="meta")
        lin.weight = nn.Parameter(wg, requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(expert_part(b, g, Proj.DOWN, layout), requires_grad=False)
        out.append(lin)
    return RowGroupLinears(out)


def split_row_groups(module: nn.Linear) -> RowGroupLinears:
    """The ``RowGroupLinears`` computing what ``module`` computes (``row_groups(module)`` > 0):
    group g's linear holds copies of its rows (and bias entries)."""
    groups = row_groups(module)
    if not groups:
        raise ValueError(f"{type(module).__name__} does not apply its rows per input group")
    return _split(module, groups)

