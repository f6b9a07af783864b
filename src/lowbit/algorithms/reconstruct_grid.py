"""One linear's weights on a GGML affine grid as block-reconstruction parameters (the contract of
``lowbit.algorithms.reconstruct``, for ``reconstruct_layer(..., offsets=...)``).

The grid (``lowbit.numerics.ggml_codes.GgmlGrid``) is the one the encoder's scales and mins lay:
weight (r, k) takes ``step * (c - zero) - offset`` of its group for an integer code c in [cmin,
cmax]; the scales and mins stay as chosen (the file's bytes other than the codes do not change).
Each weight's continuous code is u = (w + offset) / step + zero; the code is the integer nearest
to u + V, clamped to [cmin, cmax], with one offset V in [-0.5, 0.5] per weight (SignRound's
parametrization, in code units: every grid step is 1). The given codes (GPTQ's) are where V
starts: V = 0 where the given code is u's nearest; elsewhere (GPTQ moved it, by one step or more
to compensate earlier columns' errors) u is replaced by the midpoint between the given code and
its neighbour toward the float weight and V starts 0.05 on the given code's side, so that the
start reproduces every given code exactly and the steps can take it one step back toward w.
Groups whose step is 0 (all-zero blocks) keep their codes and take no gradient.

The reconstruction's steps compute with ``value()``, the exact dequantization of the codes in
llama.cpp's order (``GgmlGrid.values``; also what the evaluations and the next layer's inputs
use), and ``step`` moves V by the sign of the straight-through gradient, the rounded weight's
gradient times the grid step, without autograd. ``weight()`` is the same straight-through
function as an autograd expression, ``(x + (r - x).detach() - zero) * step - offset`` (x = u + V,
r its code), equal to ``value()`` in the forward.
"""

from __future__ import annotations

import torch

from lowbit.algorithms.reconstruct_steps import Unrounded
from lowbit.numerics.ggml_codes import GgmlGrid


class GridOffsets:
    """A GGML affine grid's codes as reconstruction offsets (module docstring)."""

    fused = True  # the steps compute with ``value()`` and ``step`` moves V without autograd
    c = None      # no scale coefficients: the grid's scales and mins are fixed

    def __init__(self, w: torch.Tensor, grid: GgmlGrid, codes: torch.Tensor) -> None:
        self.grid, self.codes0 = grid, codes.to(torch.int32)
        self.w = w.to(torch.float32)
        r, k = self.w.shape
        g = grid.group
        self.scale = grid.step.repeat_interleave(g, dim=1).reshape(r, k)
        self.offset = grid.offset.repeat_interleave(g, dim=1).reshape(r, k)
        self.nz = self.scale != 0
        self.sign = torch.sign(self.scale)  # d(weight)/dV's sign (Q3_K's steps can be negative; 0: fixed)
        safe = torch.where(self.nz, self.scale, 1.0)
        u = torch.where(self.nz, (self.w + self.offset) / safe + grid.zero, self.codes0.to(torch.float32))
        u = u.clamp(grid.cmin - 0.5, grid.cmax + 0.5)
        t = self.codes0.to(torch.float32)
        toward = torch.sign(u - t)  # from the given code toward the float weight (0: on it)
        nearest = self._code(u) == t
        # not u's nearest code (GPTQ's choice): start from the midpoint between it and its neighbour
        # toward w, just on its side, so that the given code is exact and a step can undo it
        u = torch.where(nearest, u, t + 0.5 * toward)
        V0 = torch.where(nearest, torch.zeros_like(u), -0.05 * toward)
        self.u = u
        self.V = V0.requires_grad_(True)
        if not torch.equal(torch.where(self.nz, self._code(self.u + V0), t), t):
            raise AssertionError("GridOffsets: the start does not reproduce the given codes")

    def _code(self, x: torch.Tensor) -> torch.Tensor:
        """The code of continuous codes ``x``: nearest integer (ties to even), clamped to the grid."""
        return torch.round(x).clamp(self.grid.cmin, self.grid.cmax)

    def params(self) -> list[torch.Tensor]:
        return [self.V]

    def codes(self) -> torch.Tensor:
        """int32 [R, K]: the codes of the current offsets (the given ones where the step is 0)."""
        with torch.no_grad():
            c = torch.where(self.nz, self._code(self.u + self.V), self.codes0.to(torch.float32))
        return c.to(torch.int32)

    def value(self) -> torch.Tensor:
        """The dequantized weight of the current codes, exactly as llama.cpp computes it."""
        return self.grid.values(self.codes())

    def weight(self) -> torch.Tensor:
        """The dequantized weight, rounded forward, straight-through backward in V."""
        x = self.u + self.V
        r = self._code(x.detach())
        w = (x + (r - x).detach() - self.grid.zero) * self.scale - self.offset
        return w  # a zero step gives -offset, the exact value

    def step(self, grad, lr: float) -> bool:
        """V = clamp(V - sign(dL/dV) * lr, -0.5, 0.5) for the rounded weight's gradient ``grad`` (a
        tensor or a ``reconstruct_steps.Unrounded``): dL/dV = grad * step, straight-through, so its
        sign is grad's times the step's; no autograd. Returns True (done)."""
        g = grad.value() if isinstance(grad, Unrounded) else grad
        with torch.no_grad():
            self.V.sub_(torch.sign(g).mul_(self.sign).mul_(lr)).clamp_(-0.5, 0.5)
        return True

    def store(self, module) -> tuple[int, int]:
        """Nothing is written to ``module`` (the caller reads ``codes()``); (codes changed, 0)."""
        return int((self.codes() != self.codes0).sum()), 0
