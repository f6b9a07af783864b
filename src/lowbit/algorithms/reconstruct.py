"""Block-output reconstruction: choose each weight's rounding direction so that the quantized
decoder layer reproduces the float layer's output on the calibration inputs.

What stays fixed: every scale (block scales, global scales, static input scales) as the
quantizer chose them, so the result is codes and scales of the scheme's own format, exactly
representable in every file format and backend. What moves: for each weight w with effective
scale e, v = w / e lies between two neighbours lo <= v <= hi of the element grid; the code is
the grid value nearest to v + V * (hi - lo), with one offset V in [-0.5, 0.5] per weight
(auto-round's SignRound, on the format's own grid instead of a uniform one). V starts at 0 where
the given codes (GPTQ's, or RTN's) are round-to-nearest's, and just past the midpoint toward the
given neighbour elsewhere (GPTQ's choices, clamped to the two neighbours).

Objective: the mean squared error between the layer's output with the offsets (weights rounded
in the forward pass, straight-through in the backward; activations quantized the same way for
schemes with quantized inputs) and the float layer's output, over the calibration batches.
Steps: ``iters`` signed-gradient steps of size ``lr`` (default 1 / iters, decaying linearly to
0), one batch per step in turn. The codes of the best step seen (measured on the whole
calibration set every ``eval_every`` steps, and at the start) are kept: the result is never
worse than the codes it started from on the calibration data. Deterministic: no sampling.
Memory: one layer's float copy, the offsets and the targets (one layer output per batch).

Symmetric element formats only (INT, FP4/FP6/FP8); asymmetric INT specs (zero points) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.errors import QuantizationError
from lowbit.numerics import get_format
from lowbit.quant import effective_scale, fake_quantize
from lowbit.quant.groups import group_view, ungroup
from lowbit.quant.qtensor import QuantizedTensor


@dataclass(frozen=True)
class ReconstructOptions:
    iters: int = 200
    lr: float | None = None          # signed step in grid units; None: 1 / iters
    eval_every: int = 25             # steps between full-set evaluations (the best is kept)


@dataclass
class ReconstructReport:
    mse_start: float = 0.0           # layer output MSE with the given codes
    mse_end: float = 0.0             # with the codes kept
    changed: int = 0                 # weights whose code changed
    weights: int = 0
    best_step: int = 0
    history: list[float] = field(default_factory=list)


def _grid(fmt) -> torch.Tensor:
    """Every finite value of an element format, sorted, unique (float32)."""
    n = 1 << fmt.bits
    vals = fmt.decode(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    vals = vals[torch.isfinite(vals)]
    return torch.unique(vals).sort().values


def _expand(scale_like: torch.Tensor, spec, n: int, shape) -> torch.Tensor:
    """A per-group quantity [..., G] as one value per element [..., n]."""
    g = group_view(torch.zeros(shape, dtype=torch.float32), spec)
    return ungroup(scale_like.unsqueeze(-1).expand_as(g), n)


class _Offsets:
    """One linear's weights as grid offsets: the STE forward and the final codes."""

    def __init__(self, q, w: torch.Tensor) -> None:
        qt: QuantizedTensor = q.weight_qtensor()
        spec = qt.spec
        if qt.zero_point is not None or not spec.symmetric:
            raise QuantizationError(f"layer {q.name!r}: reconstruction supports symmetric weight formats only "
                                    f"({spec.describe()} has zero points)")
        self.q, self.qt, self.fmt = q, qt, get_format(spec.format)
        out_f, in_f = qt.codes.shape
        eff = effective_scale(qt.scale, spec, qt.global_scale).to(torch.float32)
        self.e = _expand(eff, spec, in_f, (out_f, in_f))
        nz = self.e != 0
        self.v = torch.where(nz, w.to(torch.float32) / torch.where(nz, self.e, 1.0), 0.0)
        grid = _grid(self.fmt).to(self.v.device)
        idx = torch.searchsorted(grid, self.v.clamp(grid[0], grid[-1])).clamp(1, grid.numel() - 1)
        lo, hi = grid[idx - 1], grid[idx]
        self.step = (hi - lo)
        start = torch.where(nz, self.fmt.decode(qt.codes), 0.0)
        rtn = self.fmt.decode(self.fmt.encode(self.v))
        t = torch.minimum(torch.maximum(start, lo), hi)
        # where the given code is RTN's, start at v itself (SignRound's V = 0); elsewhere just past
        # the midpoint toward the given neighbour, so that a few steps can undo either choice
        step = torch.where(self.step > 0, self.step, 1.0)
        past = ((lo + hi) / 2 - self.v) / step + 0.05 * torch.sign(t - self.v)
        V0 = torch.where(start == rtn, torch.zeros_like(self.v), past)
        self.V = V0.clamp(-0.5, 0.5).requires_grad_(True)
        self.nz = nz

    def rounded(self) -> torch.Tensor:
        """The grid values of v + V * step (round to nearest even on the format's grid)."""
        x = (self.v + self.V.detach() * self.step)
        return self.fmt.decode(self.fmt.encode(x))

    def weight(self) -> torch.Tensor:
        """The dequantized weight, rounded forward, straight-through backward."""
        x = self.v + self.V * self.step
        r = self.fmt.decode(self.fmt.encode(x.detach()))
        return torch.where(self.nz, (x + (r - x).detach()) * self.e, 0.0)

    def codes(self) -> torch.Tensor:
        c = self.fmt.encode(self.v + self.V.detach() * self.step)
        return torch.where(self.nz, c, torch.zeros_like(c))


class _SoftLinear(nn.Module):
    """A QuantLinear's forward with its weight as offsets (activations QDQ'd straight-through)."""

    def __init__(self, q, off: _Offsets) -> None:
        super().__init__()
        self.q, self.off = q, off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        a = q.scheme.input_activations
        x32 = x.to(torch.float32)
        if a is not None:
            with torch.no_grad():
                xq = fake_quantize(x32, a, scale=q.input_scale, global_scale=q.input_global_scale)
            x32 = x32 + (xq - x32).detach()
        b = None if q.bias is None else q.bias.to(torch.float32)
        return F.linear(x32, self.off.weight(), b).to(x.dtype)


def _run(layer: nn.Module, calls, device) -> list[torch.Tensor]:
    """The layer's hidden-state output per call (args, kwargs), with autograd as the caller has it."""
    from lowbit.calls import move_call

    outs = []
    for call in calls:
        args, kwargs = move_call(call, device)
        out = layer(*args, **kwargs)
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return outs


def reconstruct_layer(layer: nn.Module, targets: list[torch.Tensor], float_weights: dict[str, torch.Tensor],
                      inputs, options: ReconstructOptions, set_submodule, device=None) -> ReconstructReport:
    """Re-round the QuantLinears of ``layer`` named in ``float_weights`` (relative name -> the float
    weight they were quantized from) to minimise the MSE of ``layer``'s outputs on ``inputs`` (the
    calibration batches, as (args, kwargs); run on ``device`` when given) against ``targets`` (one
    tensor per batch); their codes are replaced in place."""
    from lowbit.modules import QuantLinear

    def run(m, calls):
        return _run(m, calls, device)

    mods = {n: layer.get_submodule(n) for n in float_weights}
    offs = {n: _Offsets(m, float_weights[n]) for n, m in mods.items() if isinstance(m, QuantLinear)}
    rep = ReconstructReport(weights=sum(o.v.numel() for o in offs.values()))
    if not offs or options.iters <= 0:
        return rep
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    soft = {n: _SoftLinear(mods[n], o) for n, o in offs.items()}
    for n, s in soft.items():
        set_submodule(layer, n, s)

    def full_mse() -> float:
        with torch.no_grad():
            outs = run(layer, inputs)
            return float(sum(F.mse_loss(o.float(), t.float(), reduction="sum") for o, t in zip(outs, targets))
                         / sum(t.numel() for t in targets))

    try:
        lr0 = options.lr if options.lr is not None else 1.0 / options.iters
        best = full_mse()
        rep.mse_start = best
        rep.history.append(best)
        best_V = {n: o.V.detach().clone() for n, o in offs.items()}
        params = [o.V for o in offs.values()]
        with torch.enable_grad():
            for step in range(options.iters):
                b = step % len(inputs)
                out = run(layer, [inputs[b]])[0]
                loss = F.mse_loss(out.float(), targets[b].float())
                grads = torch.autograd.grad(loss, params)
                lr = lr0 * (1.0 - step / options.iters)
                with torch.no_grad():
                    for V, g in zip(params, grads):
                        V.sub_(lr * torch.sign(g)).clamp_(-0.5, 0.5)
                if (step + 1) % options.eval_every == 0 or step + 1 == options.iters:
                    m = full_mse()
                    rep.history.append(m)
                    if m < best:
                        best, rep.best_step = m, step + 1
                        best_V = {n: o.V.detach().clone() for n, o in offs.items()}
        with torch.no_grad():
            for n, o in offs.items():
                o.V.copy_(best_V[n])
        rep.mse_end = best
    finally:
        for n, s in soft.items():
            set_submodule(layer, n, s.q)
        for p, req in frozen:
            p.requires_grad_(req)
    for n, o in offs.items():
        codes = o.codes().to(o.qt.codes.dtype)
        rep.changed += int((codes != o.qt.codes).sum())
        mods[n].weight_codes = codes
    return rep
