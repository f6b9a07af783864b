"""The steps of block-output reconstruction over windows and ranks: which calibration windows a
step takes, and a gradient sum that does not depend on how they are split. The contract of the
reconstruction itself is in ``lowbit.algorithms.reconstruct``.

Atoms: the windows of every calibration batch (a batch whose target has no window dimension is
one atom), numbered in global batch order: rank 0's batches first, then rank 1's, as one
process holding all the batches numbers them. A step takes ``per_step`` atoms strided over the
set: with A atoms and U = ceil(A / per_step) units, unit u is atoms u, u + U, u + 2U, ... and
step s takes unit s mod U. Every rank runs the forward and backward of the atoms of the step it
holds, one atom at a time, so under torchrun all ranks work on every step (data parallel over
the step's windows) when they hold contiguous shares of the batches, as the calibrator gives.

Exact sum (``exact_sum``): each atom's gradient (float32) is rounded to a multiple of 2^-e, where
e is chosen from the largest magnitude over all atoms and ranks so that any sum of the rounded
values is an integer multiple of 2^-e below 2^52 * 2^-e. Float64 sums of such values are exact,
hence independent of order and of the split over ranks: one process and any number of ranks get
the same bits. The rounding keeps 52 - ceil(log2 A) bits below the largest magnitude of each
tensor (float32 itself keeps 24). A step of one atom in one process (the default one window a
step) rounds in float32 instead (``_rounded_float32``: the same bits, without float64 temporaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.calls import slice_call
from lowbit.errors import QuantizationError
from lowbit.kernels.select import Implementation, allows


@dataclass(frozen=True)
class Unrounded:
    """A one-atom gradient sum left for the caller to round (``exact_sum``'s ``defer``): the
    gradient ``g`` (float32) and the exponent ``e``: the sum is ``_rounded_float32(g, e)``."""

    g: torch.Tensor
    e: int

    def value(self) -> torch.Tensor:
        return _rounded_float32(self.g, self.e)


@dataclass(frozen=True)
class Atom:
    """One window of a local calibration batch (``rows`` None: the whole batch)."""

    batch: int
    rows: slice | None

    def take(self, inputs, targets, weights, layout=None):
        """(call, target, token weights) of this atom; ``layout`` (``lowbit.call_layout.CallLayout``)
        says where the call and the target hold their windows (None: along the first dimension)."""
        call, tgt, wts = inputs[self.batch], targets[self.batch], weights[self.batch]
        if self.rows is None:
            return call, tgt, wts
        r = self.rows
        if layout is not None:
            return (layout.cut(call, r.start, r.stop), layout.cut_output(tgt, r.start, r.stop),
                    layout.cut_output(wts, r.start, r.stop))
        return slice_call(call, tgt.shape[0], r.start, r.stop), tgt[r], wts[r]


class StepPlan:
    """The atoms of each step on this rank, over the ranks of ``group`` (lowbit.dist.Group; None
    or not distributed: one process). ``per_step``: atoms a step takes (None: as many as the
    largest calibration batch has windows, on any rank). ``layout`` (``lowbit.call_layout.CallLayout``):
    the targets' window axis (None: the first of a target of three or more dimensions)."""

    def __init__(self, targets: list[torch.Tensor], per_step: int | None, group, layout=None) -> None:
        self.group = group if group is not None and group.distributed else None
        self.local = [a for j, t in enumerate(targets) for a in _atoms(j, t, layout)]
        counts = self.gather([len(self.local)])
        rank = 0 if self.group is None else self.group.rank
        self.first = sum(counts[:rank])
        self.total = sum(counts)
        if per_step is None:
            per_step = max(self.gather([max((len(_atoms(0, t, layout)) for t in targets), default=0)]))
        self.per_step = max(1, min(per_step, self.total)) if self.total else 0
        self.units = -(-self.total // self.per_step) if self.total else 0

    def gather(self, values: list) -> list:
        """Every rank's list, concatenated in rank (global batch) order."""
        return values if self.group is None else [v for part in self.group.gather_objects(values) for v in part]

    def atoms(self, step: int) -> list[Atom]:
        """This rank's atoms of step ``step`` (possibly none)."""
        u = step % self.units
        end = self.first + len(self.local)
        return [self.local[g - self.first] for g in range(u, self.total, self.units) if self.first <= g < end]

    def step_atoms(self, step: int) -> int:
        """How many atoms step ``step`` takes over all ranks."""
        return len(range(step % self.units, self.total, self.units))

    def exact_sum(self, grads: list[list[torch.Tensor | None]], like: list[torch.Tensor], what: str,
                  defer: frozenset[int] = frozenset()) -> list:
        """Per tensor of ``like``, the sum of this step's atoms' gradients over all ranks
        (``grads[a][i]``: atom a's gradient of tensor i on this rank, None for zero), rounded as
        the module docstring says; float32, the same bits on every rank and for any split.
        For the indices in ``defer``, where the one-atom float32 form applies, an ``Unrounded``
        instead (the caller rounds it in a pass of its own, lowbit.kernels.offsets).
        A non-finite gradient is a QuantizationError naming ``what``."""
        dev = like[0].device
        peak = torch.zeros(len(like), dtype=torch.float32, device=dev)
        for per_atom in grads:
            for i, g in enumerate(per_atom):
                if g is not None:
                    peak[i] = torch.maximum(peak[i], g.detach().abs().amax())
        if self.group is not None:
            self.group.max_(peak)
        if not bool(torch.isfinite(peak).all()):
            raise QuantizationError(f"{what}: the reconstruction's gradient is not finite (NaN or Inf in the "
                                    f"calibration activations or targets)")
        spare = math.ceil(math.log2(max(self.total, 1)))
        out = []
        for i, t in enumerate(like):
            m = float(peak[i])
            e = 0 if m == 0.0 else 52 - spare - math.frexp(m)[1]  # m < 2^E: every |rounded| <= 2^(52 - spare)
            given = [per_atom[i] for per_atom in grads if per_atom[i] is not None]
            if (self.group is None and len(given) == 1 and given[0].dtype == torch.float32 and 0 <= e <= 126
                    and allows(Implementation.TORCH)):  # one atom in one process: the float32 form (reference: float64)
                out.append(Unrounded(given[0].detach(), e) if i in defer else _rounded_float32(given[0].detach(), e))
                continue
            acc = torch.zeros(t.shape, dtype=torch.float64, device=dev)
            for per_atom in grads:
                g = per_atom[i]
                if g is not None:
                    acc += torch.round(g.detach().to(torch.float64) * 2.0 ** e)
            if self.group is not None:
                self.group.sum_(acc)
            out.append((acc * 2.0 ** -e).to(torch.float32))
        return out


def _rounded_float32(g: torch.Tensor, e: int) -> torch.Tensor:
    """One float32 gradient rounded to a multiple of 2^-e, as ``exact_sum`` rounds and sums it in
    float64 (0 <= e <= 126): g * 2^e is exact in float32 (a power-of-two scaling below 2^52 in
    magnitude), its round-half-even integer k is a float32 (below 2^23 it is rounded, from 2^23 on
    g * 2^e has no fraction), adding +0 turns a -0 into the +0 the float64 sum starts from, and
    k * 2^-e is a normal float32 or zero, so every step is exact and the bits are the float64
    path's; in place on one new tensor instead of float64 temporaries."""
    r = torch.mul(g, 2.0 ** e)
    r.round_()
    r.add_(0.0)
    return r.mul_(2.0 ** -e)


def _atoms(j: int, t: torch.Tensor, layout=None) -> list[Atom]:
    if layout is not None:
        a = layout.output
        n = t.shape[a.dim] // a.rows
        return [Atom(j, None)] if n <= 1 else [Atom(j, slice(i, i + 1)) for i in range(n)]
    if t.dim() < 3:
        return [Atom(j, None)]
    return [Atom(j, slice(i, i + 1)) for i in range(t.shape[0])]
