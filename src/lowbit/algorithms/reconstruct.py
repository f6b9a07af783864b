"""Block-output reconstruction: choose each weight's rounding direction (and optionally each
block scale) so that the quantized decoder layer reproduces the float layer's output on the
calibration inputs.

What moves: for each weight w with effective scale e, v = w / e lies between two neighbours
lo <= v <= hi of the element grid; the code is the grid value nearest to v + V * (hi - lo), with
one offset V in [-0.5, 0.5] per weight (auto-round's SignRound, on the format's own grid and in
units of the local grid step instead of absolute units). V starts at 0 where the given codes
(RTN's, or GPTQ's) are round-to-nearest's, and just past the midpoint toward the given neighbour
elsewhere (GPTQ's choices, clamped to the two neighbours). With ``scales``, each per-channel or
per-group weight scale is also re-chosen: the scale format's value nearest c * (the block's amax
scale), one coefficient c in [0.5, 1] per block (the given scale's own coefficient when that is
above 1), straight-through in the backward; until c moves the given scale is kept exactly.
What stays fixed: global scales, static input scales and E8M0 (MX) block scales. The result is
codes and scales of the scheme's own format, exactly representable in every file format and
backend.

Objective: the mean squared error between the layer's output with the offsets (weights rounded
in the forward pass, straight-through in the backward; activations quantized the same way for
schemes with quantized inputs) and the float layer's output, over the calibration batches, each
token's error relative to the mean square of its target (``token_weights``: the next layer
normalizes every token, and attention-sink tokens would otherwise dominate).
Steps: ``iters`` signed-gradient steps of size ``lr`` (default ``default_lr(iters)`` =
min(1 / iters, 0.02), decaying linearly to 0), one batch per step in turn. The codes of the best
step seen (measured on the whole calibration set every ``eval_every`` steps, and at the start)
are kept: the result is never worse than the codes it started from on the calibration data.
Deterministic: no sampling.
Memory: one layer's float copy, the offsets and the targets (one layer output per batch).

Symmetric element formats only (INT, FP4/FP6/FP8); asymmetric INT specs (zero points) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.errors import QuantizationError
from lowbit.kernels import codes
from lowbit.numerics import FormatName, get_format
from lowbit.quant import effective_scale, fake_quantize
from lowbit.quant.groups import group_view, reduce_groups, ungroup
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.quant.scales import amax_divisor, divide, raw_block_scales
from lowbit.schemes.spec import Granularity


C_MIN = 0.5  # the smallest block-scale coefficient: at most halve a block's amax scale

# The largest default first step, in grid units. With 1 / iters alone, 20 steps start at 0.05 and
# overshoot: Gemma-3-270M nvfp4, GPTQ + 20 steps, +30.04% ppl at 0.05 against +16.74% at 0.02
# (GPTQ alone +18.89%); SmolLM2 +19.86% at 0.05, +19.39% at 0.02 (bench/RESULTS.md).
MAX_DEFAULT_LR = 0.02


def default_lr(iters: int) -> float:
    """The first step when none is given: min(1 / iters, MAX_DEFAULT_LR), so that from 50 steps on
    the offsets can still travel a whole grid step (the sum of the linearly decaying steps is
    about iters * lr / 2), and fewer steps move less rather than overshooting."""
    return min(1.0 / iters, MAX_DEFAULT_LR)


@dataclass(frozen=True)
class ReconstructOptions:
    iters: int = 200
    lr: float | None = None          # signed step in grid units; None: default_lr(iters)
    eval_every: int = 10             # steps between full-set evaluations (the best is kept)
    scales: bool = False             # also tune each per-channel / per-group scale (see _Offsets.scale)


@dataclass
class ReconstructReport:
    mse_start: float = 0.0           # layer output MSE with the given codes
    mse_end: float = 0.0             # with the codes kept
    changed: int = 0                 # weights whose code changed
    scales_changed: int = 0          # block scales that changed
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
    """One linear's weights as grid offsets (and, with ``scales``, block-scale coefficients): the
    straight-through forward and the final codes and scales."""

    def __init__(self, q, w: torch.Tensor, scales: bool) -> None:
        qt: QuantizedTensor = q.weight_qtensor()
        spec = qt.spec
        if qt.zero_point is not None or not spec.symmetric:
            raise QuantizationError(f"layer {q.name!r}: reconstruction supports symmetric weight formats only "
                                    f"({spec.describe()} has zero points)")
        self.qt, self.spec, self.fmt = qt, spec, get_format(spec.format)
        self.w = w.to(torch.float32)
        self.grid = _grid(self.fmt).to(self.w.device)
        self.s0 = qt.scale.to(torch.float32)
        self.gs = None if qt.global_scale is None else qt.global_scale.to(torch.float32)
        self.c = None
        if scales and _tunable(spec):
            amax = reduce_groups(group_view(self.w.abs(), spec), spec, lambda t, d: t.amax(d))
            raw = _raw_scale(amax, spec, self.gs)                 # the stored scale of c = 1 (no rounding),
            self.raw = torch.where(self.s0 < 0, -raw, raw)         # signed as the given one (full-range INT)
            pos = self.raw > 0
            self.c0 = torch.where(pos, self.s0 / torch.where(pos, self.raw, 1.0), 1.0)
            self.c_hi = torch.clamp_min(self.c0, 1.0)
            self.c = self.c0.clone().requires_grad_(True)
        v, e, self.nz = self._values(self.s0)
        lo, hi = self._neighbours(v)
        start = torch.where(self.nz, self.fmt.decode(qt.codes), 0.0)
        rtn = self.fmt.decode(self.fmt.encode(v))
        t = torch.minimum(torch.maximum(start, lo), hi)
        # where the given code is RTN's, start at v itself (SignRound's V = 0); elsewhere just past
        # the midpoint toward the given neighbour, so that a few steps can undo either choice
        step = torch.where(hi > lo, hi - lo, 1.0)
        past = ((lo + hi) / 2 - v) / step + 0.05 * torch.sign(t - v)
        V0 = torch.where(start == rtn, torch.zeros_like(v), past)
        self.V = V0.clamp(-0.5, 0.5).requires_grad_(True)
        if self.c is None:  # fixed scales: v, its grid step and e never change
            self.v_fixed, self.step_fixed, self.e_fixed = v, hi - lo, e

    def params(self) -> list[torch.Tensor]:
        return [self.V] if self.c is None else [self.V, self.c]

    def _values(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w / e, e, e != 0), per element, for stored block scales ``scale`` (differentiable in it)."""
        n = self.w.shape[-1]
        e = _expand(effective_scale(scale, self.spec, self.gs), self.spec, n, self.w.shape)
        nz = e.detach() != 0
        return torch.where(nz, self.w / torch.where(nz, e, 1.0), 0.0), e, nz

    def _neighbours(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.grid
        idx = torch.searchsorted(g, v.detach().clamp(g[0], g[-1])).clamp(1, g.numel() - 1)
        return g[idx - 1], g[idx]

    def scale(self) -> torch.Tensor:
        """The stored block scales: the given ones until a coefficient moves, then the scale
        format's value nearest c * (the amax scale); straight-through in the backward."""
        if self.c is None:
            return self.s0
        c = self.c
        raw = c * self.raw
        with torch.no_grad():
            val = torch.where(c.detach() != self.c0, _round_scale(raw.detach(), self.spec), self.s0)
        return val + (raw - raw.detach())

    def _x(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v + V * step, the effective scale per element, its non-zero mask)."""
        if self.c is None:
            return self.v_fixed + self.V * self.step_fixed, self.e_fixed, self.nz
        v, e, nz = self._values(self.scale())
        lo, hi = self._neighbours(v)
        return v + self.V * (hi - lo), e, nz

    def weight(self) -> torch.Tensor:
        """The dequantized weight, rounded forward, straight-through backward."""
        x, e, nz = self._x()
        r = self.fmt.decode(self.fmt.encode(x.detach()))
        return torch.where(nz, (x + (r - x).detach()) * e, 0.0)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, stored scales) of the current offsets and coefficients."""
        with torch.no_grad():
            x, _, nz = self._x()
            c = self.fmt.encode(x)
            return torch.where(nz, c, torch.zeros_like(c)), self.scale().detach().clone()


def _tunable(spec) -> bool:
    """Whether the block-scale coefficients are tuned for ``spec``: per-channel or per-group
    scales stored as fp32 or as a minifloat (E8M0's powers of two are left as chosen)."""
    return spec.granularity in (Granularity.CHANNEL, Granularity.GROUP) and spec.scale_format is not FormatName.E8M0


def _raw_scale(amax: torch.Tensor, spec, gs) -> torch.Tensor:
    if spec.scale_format is FormatName.FP32:
        return divide(amax, amax_divisor(spec))
    return raw_block_scales(amax, spec, gs)


def _round_scale(raw: torch.Tensor, spec) -> torch.Tensor:
    """A stored scale of the spec's scale format from an unrounded one (fp32: the floor only)."""
    if spec.scale_format is FormatName.FP32:
        return raw if spec.scale_floor is None else torch.clamp_min(raw, spec.scale_floor)
    return codes.qdq(get_format(spec.scale_format), raw)


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


def token_weights(target: torch.Tensor) -> torch.Tensor:
    """One weight per token of a layer output [..., hidden]: 1 / its mean square (the next layer
    normalizes each token before using it, so a token's error matters relative to its size;
    without this, attention-sink tokens with hidden states 100x the others take most of the loss)."""
    ms = target.detach().float().pow(2).mean(-1, keepdim=True)
    return torch.where(ms > 0, 1.0 / torch.where(ms > 0, ms, 1.0), 1.0)


def weighted_se(out: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Squared errors weighted per token (``token_weights``)."""
    return (out.float() - target.float()).pow(2) * w


class _Batches:
    """The calibration batches over the ranks of ``group`` (lowbit.dist.Group; None: one process):
    each rank holds a contiguous share, in rank order, so global batch b is where one process has
    its batch b. One step's gradient is computed by the batch's owner and broadcast, and the
    whole-set error is summed in global batch order, so every rank makes the same choices as one
    process does, bit for bit."""

    def __init__(self, n_local: int, group) -> None:
        self.group = group if group is not None and group.distributed else None
        self.rank = 0 if self.group is None else self.group.rank
        self.counts = [n_local] if self.group is None else self.group.gather_objects(n_local)
        self.first = sum(self.counts[:self.rank])
        self.total = sum(self.counts)

    def owner(self, b: int) -> int:
        end = 0
        for r, c in enumerate(self.counts):
            end += c
            if b < end:
                return r
        raise IndexError(b)

    def gather(self, values: list) -> list:
        """Every rank's list, concatenated in global batch order."""
        return values if self.group is None else [v for part in self.group.gather_objects(values) for v in part]

    def broadcast_(self, tensors: list[torch.Tensor], src: int) -> None:
        if self.group is not None:
            for t in tensors:
                self.group.broadcast_(t, src)


def reconstruct_layer(layer: nn.Module, targets: list[torch.Tensor], float_weights: dict[str, torch.Tensor],
                      inputs, options: ReconstructOptions, set_submodule, device=None,
                      group=None) -> ReconstructReport:
    """Re-round the QuantLinears of ``layer`` named in ``float_weights`` (relative name -> the float
    weight they were quantized from) to minimise the MSE of ``layer``'s outputs on ``inputs`` (the
    calibration batches, as (args, kwargs); run on ``device`` when given) against ``targets`` (one
    tensor per batch); their codes are replaced in place. ``group`` (lowbit.dist.Group): the ranks
    that each hold a contiguous share of the batches; every rank gets the codes one process holding
    all the batches would get."""
    from lowbit.modules import QuantLinear

    def run(m, calls):
        return _run(m, calls, device)

    batches = _Batches(len(inputs), group)

    mods = {n: layer.get_submodule(n) for n in float_weights}
    offs = {n: _Offsets(m, float_weights[n], options.scales) for n, m in mods.items() if isinstance(m, QuantLinear)}
    rep = ReconstructReport(weights=sum(o.w.numel() for o in offs.values()))
    if not offs or options.iters <= 0 or batches.total == 0:
        return rep
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    soft = {n: _SoftLinear(mods[n], o) for n, o in offs.items()}
    for n, s in soft.items():
        set_submodule(layer, n, s)

    weights = [token_weights(t) for t in targets]
    numel = sum(batches.gather([sum(t.numel() for t in targets)]))

    def full_mse() -> float:
        with torch.no_grad():
            outs = run(layer, inputs)
            parts = batches.gather([float(weighted_se(o, t, w).sum()) for o, t, w in zip(outs, targets, weights)])
            total = torch.zeros((), dtype=torch.float32)
            for p in parts:  # float32, in batch order
                total = total + torch.tensor(p, dtype=torch.float32)
            return float(total / numel)

    try:
        lr0 = options.lr if options.lr is not None else default_lr(options.iters)
        best = full_mse()
        rep.mse_start = best
        rep.history.append(best)
        params = [p for o in offs.values() for p in o.params()]
        best_p = [p.detach().clone() for p in params]
        with torch.enable_grad():
            for step in range(options.iters):
                b = step % batches.total
                src = batches.owner(b)
                if src == batches.rank:
                    j = b - batches.first
                    out = run(layer, [inputs[j]])[0]
                    loss = weighted_se(out, targets[j], weights[j]).mean()
                    # an expert no token of this batch reaches has no gradient: it stays where it is
                    grads = [torch.zeros_like(p) if g is None else g.contiguous()
                             for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]
                else:
                    grads = [torch.zeros_like(p) for p in params]
                batches.broadcast_(grads, src)
                lr = lr0 * (1.0 - step / options.iters)
                with torch.no_grad():
                    by_id = {id(p): g for p, g in zip(params, grads)}
                    for o in offs.values():
                        o.V.sub_(lr * torch.sign(by_id[id(o.V)])).clamp_(-0.5, 0.5)
                        if o.c is not None:
                            o.c.sub_(lr * torch.sign(by_id[id(o.c)])).clamp_(min=C_MIN)
                            torch.minimum(o.c, o.c_hi, out=o.c)
                if (step + 1) % options.eval_every == 0 or step + 1 == options.iters:
                    m = full_mse()
                    rep.history.append(m)
                    if m < best:
                        best, rep.best_step = m, step + 1
                        best_p = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, b in zip(params, best_p):
                p.copy_(b)
        rep.mse_end = best
    finally:
        for n, s in soft.items():
            set_submodule(layer, n, s.q)
        for p, req in frozen:
            p.requires_grad_(req)
    for n, o in offs.items():
        c, scale = o.result()
        c = c.to(o.qt.codes.dtype)
        rep.changed += int((c != o.qt.codes).sum())
        rep.scales_changed += int((scale != o.s0).sum())
        mods[n].weight_codes = c
        mods[n].weight_scale = scale.to(o.qt.scale.dtype)
    return rep
