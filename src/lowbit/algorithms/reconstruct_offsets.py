"""One linear's weights as reconstruction parameters: grid offsets (and, with ``scales``,
block-scale coefficients), the rounded weight they give (straight-through in the backward) and
the codes and scales they end at. The contract is in ``lowbit.algorithms.reconstruct``.

The rounded weight of fixed scales (the default) has three implementations, chosen by the kernel
setting (lowbit.kernels.select) and equal bit for bit in the forward value and in the gradient:
``reference``, the straight-through expression as autograd records it
(``where(nz, (x + (r - x).detach()) * e, 0)``, x = v + V * step, r the nearest grid value of x),
``torch``, one autograd function that computes the same expression in the same order with
the element codes of ``lowbit.kernels.codes`` and whose backward is the gradient autograd would
give, ``(where(nz, g, 0) * e) * step``, without recording the intermediate tensors, and
``native`` (``fused``): the value in one C pass (``value``) and the step's update from the
rounded weight's gradient in another (``step``: V = clamp(V - sign(that gradient) * lr, -0.5,
0.5)), without autograd (lowbit.kernels.native, reconstruct_native.c).
"""

from __future__ import annotations

import torch

from lowbit.algorithms.reconstruct_steps import Unrounded
from lowbit.errors import QuantizationError
from lowbit.kernels import codes, offsets as fused_kernels
from lowbit.kernels.select import Implementation, allows
from lowbit.numerics import FormatName, get_format
from lowbit.quant import effective_scale
from lowbit.quant.groups import group_view, reduce_groups, ungroup
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.quant.scale_rules import amax_divisor, divide, raw_block_scales
from lowbit.schemes.spec import Granularity

C_MIN = 0.5  # the smallest block-scale coefficient: at most halve a block's amax scale


class _RoundedWeight(torch.autograd.Function):
    """where(nz, (x + (r - x)) * e, 0) for x = v + V * step, straight-through in V (the torch
    implementation of ``Offsets.weight`` with fixed scales; ``zero`` = ~nz)."""

    @staticmethod
    def forward(ctx, V, v, step, e, zero, fmt):  # noqa: D401 - autograd's signature
        # the plain expression's operations in its order, in place on two new tensors (IEEE
        # addition is commutative, so V * step + v and (r - x) + x are v + V * step and x + (r - x));
        # ``zero`` is ~nz: masked_fill(zero, 0) is where(nz, ., 0), +0 included
        x = torch.mul(V, step).add_(v)
        w = codes.decode(fmt, codes.encode(fmt, x))
        w.sub_(x).add_(x).mul_(e).masked_fill_(zero, 0.0)
        ctx.save_for_backward(step, e, zero)
        return w

    @staticmethod
    def backward(ctx, g):
        step, e, zero = ctx.saved_tensors
        return g.masked_fill(zero, 0.0).mul_(e).mul_(step), None, None, None, None, None


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


class Offsets:
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
        self.fused = False  # value and step as the native kernels (fixed scales, CPU, the setting allows it)
        if self.c is None:  # fixed scales: v, its grid step and e never change
            self.v_fixed, self.step_fixed, self.e_fixed, self.zero_fixed = v, hi - lo, e, ~self.nz
            self.fused = fused_kernels.fusable(self.fmt, self.V, v, self.step_fixed, e, self.zero_fixed)

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

    def value(self) -> torch.Tensor:
        """The rounded weight's value without autograd (``fused``: one C pass)."""
        with torch.no_grad():
            if self.fused:
                w = fused_kernels.rounded_weight(self.V.detach(), self.v_fixed, self.step_fixed, self.e_fixed,
                                          self.zero_fixed, self.fmt)
                if w is not None:
                    return w
            return self.weight().detach()

    def step(self, grad, lr: float) -> bool:
        """``fused``: V = clamp(V - sign(d) * lr, -0.5, 0.5) in place for the rounded weight's
        gradient ``grad`` (a tensor, or a ``reconstruct_steps.Unrounded`` one-atom sum, rounded in
        the same pass; d: its gradient in V, ``_RoundedWeight.backward``), in one C pass; returns
        False (nothing done) when not fused, the caller then takes autograd's gradient."""
        if not self.fused:
            return False
        g, e = (grad.g, grad.e) if isinstance(grad, Unrounded) else (grad, None)
        with torch.no_grad():
            return fused_kernels.offset_step(self.V.data, g.contiguous(), self.e_fixed, self.step_fixed,
                                             self.zero_fixed, lr, e)

    def weight(self) -> torch.Tensor:
        """The dequantized weight, rounded forward, straight-through backward."""
        if self.c is None and allows(Implementation.TORCH):
            return _RoundedWeight.apply(self.V, self.v_fixed, self.step_fixed, self.e_fixed, self.zero_fixed, self.fmt)
        x, e, nz = self._x()
        r = self.fmt.decode(self.fmt.encode(x.detach()))
        return torch.where(nz, (x + (r - x).detach()) * e, 0.0)

    def store(self, module) -> tuple[int, int]:
        """The current codes and scales into the QuantLinear ``module``; (codes changed, scales changed)."""
        c, scale = self.result()
        c = c.to(self.qt.codes.dtype)
        changed, scales_changed = int((c != self.qt.codes).sum()), int((scale != self.s0).sum())
        module.weight_codes = c
        module.weight_scale = scale.to(self.qt.scale.dtype)
        return changed, scales_changed

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
