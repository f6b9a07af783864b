"""The reconstruction's steps over windows and ranks (lowbit.algorithms.reconstruct_steps): which
windows each rank runs in each step, and a gradient sum whose bits do not depend on the split."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lowbit.algorithms.reconstruct_steps import Atom, StepPlan
from lowbit.dist import Group
from lowbit.errors import QuantizationError


@dataclass(frozen=True)
class _Imagined(Group):
    """One rank of a job whose other ranks are imagined, holding ``counts`` atoms."""

    counts: tuple = ()

    def gather_objects(self, obj):
        return [obj if r == self.rank else [self.counts[r]] for r in range(self.world)]


def _targets(batches: list[int]) -> list[torch.Tensor]:
    return [torch.zeros(b, 4, 8) for b in batches]


def test_steps_take_the_windows_strided_and_every_rank_works_on_every_step():
    one = StepPlan(_targets([4, 4, 4, 4]), None, None)
    assert (one.total, one.per_step, one.units) == (16, 4, 4)
    assert one.atoms(0) == [Atom(b, slice(r, r + 1)) for b, r in [(0, 0), (1, 0), (2, 0), (3, 0)]]
    assert one.atoms(5) == one.atoms(1) == [Atom(b, slice(1, 2)) for b in range(4)]
    # rank 1 of 2 holds batches 2 and 3 (windows 8-15): two windows of every step
    r1 = StepPlan(_targets([4, 4]), 4, _Imagined(rank=1, world=2, distributed=True, counts=(8, 8)))
    assert (r1.first, r1.total, r1.units) == (8, 16, 4)
    assert r1.atoms(1) == [Atom(0, slice(1, 2)), Atom(1, slice(1, 2))]  # global windows 9 and 13
    # one window a step walks the windows in order; a step never takes more windows than there are
    assert [StepPlan(_targets([2, 1]), 1, None).atoms(s) for s in range(4)] == [
        [Atom(0, slice(0, 1))], [Atom(0, slice(1, 2))], [Atom(1, slice(0, 1))], [Atom(0, slice(0, 1))]]
    assert StepPlan(_targets([2, 1]), 8, None).per_step == 3
    assert StepPlan([torch.zeros(5, 8)], None, None).atoms(0) == [Atom(0, None)]  # no window dimension: one atom


def _atoms_grads() -> list[list[torch.Tensor]]:
    """Six atoms' gradients of one tensor, adversarial: magnitudes from 2^-40 to 4 side by side,
    cancellations, a float32 subnormal, exact float32 ties."""
    gen = torch.Generator().manual_seed(0)
    atoms = [[torch.randn(64, generator=gen) * 2.0 ** torch.randint(-40, 3, (64,), generator=gen).float()]
             for _ in range(6)]
    atoms[2][0][:4] = torch.tensor([1.0, 1e-45, -3.0, 2.0 ** -24])
    atoms[3][0][:4] = torch.tensor([-1.0, 0.0, 3.0, 1.0])
    return atoms


def _rank(rank: int, cut: int, init: str, out: str) -> None:
    """Rank ``rank`` of 2 (gloo): rank 0 holds atoms[:cut], rank 1 the rest; both write their sum."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        atoms = _atoms_grads()
        mine = atoms[:cut] if rank == 0 else atoms[cut:]
        plan = StepPlan(_targets([len(mine)]), 6, Group(rank=rank, world=2, distributed=True))
        assert plan.total == 6 and len(plan.atoms(0)) == len(mine)
        torch.save(plan.exact_sum(mine, [torch.zeros(64)], "x")[0], f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_sum_has_the_same_bits_for_every_order():
    atoms = _atoms_grads()
    plan = StepPlan(_targets([6]), 6, None)
    whole = plan.exact_sum(atoms, [torch.zeros(64)], "x")[0]
    assert torch.equal(plan.exact_sum(atoms[::-1], [torch.zeros(64)], "x")[0], whole)
    assert torch.equal(plan.exact_sum(atoms[3:] + atoms[:3], [torch.zeros(64)], "x")[0], whole)
    true = sum(a[0].double() for a in atoms)
    assert torch.equal(whole, true.float())  # the float32 nearest the true sum here (52 - 3 bits kept)


@pytest.mark.subprocess
@pytest.mark.parametrize("cut", [1, 4])
def test_two_ranks_sum_to_the_bits_of_one_process(tmp_path, cut):
    import torch.multiprocessing as mp

    whole = StepPlan(_targets([6]), 6, None).exact_sum(_atoms_grads(), [torch.zeros(64)], "x")[0]
    out = str(tmp_path / "sum")
    mp.spawn(_rank, args=(cut, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    for r in (0, 1):
        assert torch.equal(torch.load(f"{out}.{r}", weights_only=True), whole), (cut, r)


def test_a_non_finite_gradient_is_one_error_naming_the_layer():
    plan = StepPlan(_targets([2]), 2, None)
    with pytest.raises(QuantizationError, match="layer 'model.layers.3'"):
        plan.exact_sum([[torch.tensor([1.0, float("nan")])]], [torch.zeros(2)], "the decoder layer 'model.layers.3'")
    assert torch.equal(plan.exact_sum([[None], [None]], [torch.zeros(2)], "x")[0], torch.zeros(2))  # no gradient: 0


def _adversarial_gradient() -> torch.Tensor:
    """Ties at the rounding quantum, -0, subnormals, values just below and at 2^23 quanta, the
    peak on a power of two and just below the next one."""
    e = 52 - 4 - 1  # 16 atoms (spare 4), the peak below 2^1
    q = 2.0 ** -e
    vals = [1.0, 1.9999999, -1.5, 0.0, -0.0, 0.5 * q, -0.5 * q, 1.5 * q, -2.5 * q, 2.5 * q, 0.49 * q,
            1e-45, -1e-45, 1e-39, 2.0 ** -23, (2 ** 23 + 0.5) * q, (2 ** 23 - 0.5) * q, -(2 ** 24 - 0.5) * q,
            3.0e-8, -7.1e-12]
    g = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([g, torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 10.0 ** torch.randint(
        -30, 0, (4096,), generator=torch.Generator().manual_seed(2)).float()])


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -60, 2.0 ** -75, 2.0 ** -100, 2.0 ** 40, 2.0 ** 60])
def test_one_atoms_float32_sum_has_the_float64_bits(scale):
    """One atom in one process takes the float32 form of the rounding; its bits are the float64
    path's (the reference implementation) on ties, signed zeros, subnormals and every exponent
    range, including the ones the float32 form hands back to float64."""
    from lowbit.kernels import Implementation, using

    g = _adversarial_gradient() * scale
    plan = StepPlan(_targets([16]), 1, None)
    fast = plan.exact_sum([[g]], [torch.zeros_like(g)], "x")[0]
    with using(Implementation.REFERENCE):
        slow = plan.exact_sum([[g]], [torch.zeros_like(g)], "x")[0]
    assert fast.dtype == slow.dtype == torch.float32
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))  # -0 and +0 told apart
    assert (fast == 0).any() and not torch.signbit(fast[fast == 0]).any()
