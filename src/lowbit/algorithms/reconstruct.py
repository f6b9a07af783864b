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
min(1 / iters, 0.02), decaying linearly to 0), each on ``batch_size`` calibration windows (None:
as many as a calibration batch has), strided over the whole set so that the steps take every
window in turn (``lowbit.algorithms.reconstruct_steps``: with 16 windows and 4 a step, step 0
takes windows 0, 4, 8, 12, step 1 windows 1, 5, 9, 13, ...). Each window's forward and backward
runs alone and the step's gradient is their exact sum, so that under torchrun the ranks share
every step's windows (data parallel) and still make the choices of one process, bit for bit
(a step of one window, ``CalibrationConfig``'s default, runs on the rank that holds it).
Which codes are kept (default, ``eval_every`` None): the last step's are evaluated on the whole
calibration set (their outputs are the next layer's inputs) and checked against the given codes
on step 0's windows, whose errors with the given codes step 0 computed anyway (its offsets give
exactly those codes): when the last step's error there is lower, they are kept; otherwise the
given codes are evaluated on the whole set too and the better of the two is kept. So the result
is never worse than the given codes on step 0's windows nor, when it is there, on the whole set,
at one whole-set evaluation a layer instead of two (on SmolLM2 nvfp4 the last step was better on
the whole set in every layer of every run measured: bench/calibrate/RESULTS-calibrate.md). With
``eval_every``, the given codes are evaluated on the whole set at the start and the best of the
start, every ``eval_every`` steps and the end is kept.
Deterministic: no sampling.
Memory: one layer's float copy, the offsets, the gradients of the step's windows on this rank
(one float32 copy of the re-rounded weights per window, and a float64 sum when a step has
several windows or ranks), the targets
(one layer output per batch) and the
outputs of the best evaluation (``ReconstructReport.outputs``: the layer's outputs with the codes
kept, computed exactly as the reference backend computes them, so that a caller whose backends
match the reference can take them as the next layer's inputs instead of running the layer again).

Cost (``ReconstructReport``'s counters): ``iters`` steps of one forward + backward pass per window,
and 1 forward pass over every batch (2 when the check sends the decision to the whole set; with
``eval_every``: ``iters // eval_every + 1``, plus one when ``iters`` is not a multiple). Sibling linears reading one input (q/k/v, gate/up) quantize it once per forward
(``lowbit.backends.shared_input``), and the rounded weights of fixed scales are one autograd
function (``lowbit.algorithms.reconstruct_offsets``), bit-identical to the plain expression.

Symmetric element formats only (INT, FP4/FP6/FP8); asymmetric INT specs (zero points) are refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from lowbit.algorithms.reconstruct_modules import FixedLinear, SoftLinear, run_calls as _run
from lowbit.algorithms.reconstruct_offsets import C_MIN, Offsets
from lowbit.algorithms.reconstruct_steps import StepPlan, Unrounded
from lowbit.backends.shared_input import SharedInput

# The largest default first step, in grid units. With 1 / iters alone, 20 steps start at 0.05 and
# overshoot: Gemma-3-270M nvfp4, GPTQ + 20 steps, +30.04% ppl at 0.05 against +16.74% at 0.02
# (GPTQ alone +18.89%); SmolLM2 +19.86% at 0.05, +19.39% at 0.02 (bench/peers/RESULTS.md).
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
    eval_every: int | None = None    # steps between full-set evaluations (the best is kept); None: only
    #                                  at the start and after the last step
    batch_size: int | None = None    # calibration windows per step (None: as many as a calibration batch has)
    scales: bool = False             # also tune each per-channel / per-group scale (see Offsets.scale)

    def __post_init__(self) -> None:
        e = self.eval_every
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
            raise ValueError(f"eval_every must be a positive integer or None, got {e!r}")


@dataclass
class ReconstructReport:
    mse_start: float | None = 0.0    # layer output MSE with the given codes (None: not evaluated on
    #                                  the whole set, the check below sufficed)
    check_start: float | None = None # summed weighted squared error of step 0's windows with the given
    check_end: float | None = None   # codes, and with the codes of the last step (eval_every None)
    mse_end: float = 0.0             # with the codes kept
    changed: int = 0                 # weights whose code changed
    scales_changed: int = 0          # block scales that changed
    weights: int = 0
    best_step: int = 0
    history: list[float] = field(default_factory=list)
    steps: int = 0                   # steps taken (every rank takes every step)
    backward_calls: int = 0          # forward + backward passes (one window each) on this rank
    evals: int = 0                   # whole-set evaluations
    eval_calls: int = 0              # layer forward calls (one batch each) of the evaluations on this rank
    step_seconds: float = 0.0
    eval_seconds: float = 0.0
    # the layer's outputs per local batch with the codes kept (the best evaluation's), on the
    # device the layer ran on; None when nothing ran. Not part of the serialized report.
    outputs: list[torch.Tensor] | None = field(default=None, repr=False)


def token_weights(target: torch.Tensor) -> torch.Tensor:
    """One weight per token of a layer output [..., hidden]: 1 / its mean square (the next layer
    normalizes each token before using it, so a token's error matters relative to its size;
    without this, attention-sink tokens with hidden states 100x the others take most of the loss)."""
    ms = target.detach().float().pow(2).mean(-1, keepdim=True)
    return torch.where(ms > 0, 1.0 / torch.where(ms > 0, ms, 1.0), 1.0)


def weighted_se(out: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Squared errors weighted per token (``token_weights``)."""
    return (out.float() - target.float()).pow(2) * w


def reconstruct_layer(layer: nn.Module, targets: list[torch.Tensor], float_weights: dict[str, torch.Tensor],
                      inputs, options: ReconstructOptions, set_submodule, device=None,
                      group=None, masks: list[torch.Tensor] | None = None, layout=None,
                      offsets=None) -> ReconstructReport:
    """Re-round the QuantLinears of ``layer`` named in ``float_weights`` (relative name -> the float
    weight they were quantized from; the layer's other QuantLinears keep their codes and pass the
    gradient straight through their input QDQ) to minimise the MSE of ``layer``'s outputs on ``inputs`` (the
    calibration batches, as (args, kwargs); run on ``device`` when given) against ``targets`` (one
    tensor per batch); their codes are replaced in place. ``group`` (lowbit.dist.Group): the ranks
    that each hold a contiguous share of the batches; every rank gets the codes one process holding
    all the batches would get. ``masks`` (one [B, T] bool per batch; None: every position): the
    positions whose errors count (padding weighs nothing in the loss and the MSE). ``layout``
    (``lowbit.call_layout.CallLayout``, from the capture): along which axis each tensor of a call,
    and the layer's output, holds the batch's windows (None: the first of the hidden states).
    ``offsets(name, module, float weight)``: the parameters of the named linears of another grid
    (None: the QuantLinears' ``Offsets``; a linear it returns None for is left as it is): an
    object with ``Offsets``' ``params``, ``weight``, ``value``, ``step``, ``fused``, ``c``, ``V``, ``w``
    and ``store(module) -> (codes changed, scales changed)``, for a module that is a plain
    ``nn.Linear`` computing on float inputs (e.g. ``lowbit.algorithms.reconstruct_grid``, GGML's
    affine grids)."""
    from lowbit.modules import QuantLinear

    def run(m, calls):
        return _run(m, calls, device)

    def own(n: str, m: nn.Module, w: torch.Tensor):
        return Offsets(m, w, options.scales) if isinstance(m, QuantLinear) else None

    make = own if offsets is None else offsets
    plan = StepPlan(targets, options.batch_size, group, layout)
    mods = {n: layer.get_submodule(n) for n in float_weights}
    offs = {n: o for n, o in ((n, make(n, m, float_weights[n])) for n, m in mods.items()) if o is not None}
    rep = ReconstructReport(weights=sum(o.w.numel() for o in offs.values()))
    what = f"the decoder layer of {getattr(mods[next(iter(offs))], 'name', None) or next(iter(offs))!r}" if offs else ""
    if not offs or options.iters <= 0 or plan.total == 0:
        return rep
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    shared = SharedInput()
    soft: dict[str, nn.Module] = {n: SoftLinear(mods[n], o, shared) for n, o in offs.items()}
    for n, m in layer.named_modules():  # the layer's other QuantLinears (mixed recipes): fixed
        if isinstance(m, QuantLinear) and n not in soft:
            soft[n] = FixedLinear(m, shared)
    for n, s in soft.items():
        set_submodule(layer, n, s)

    weights = [token_weights(t) for t in targets]
    if masks is not None:
        if layout is None:
            weights = [w * m.to(w.device).reshape(w.shape[:-1]).unsqueeze(-1) for w, m in zip(weights, masks)]
        else:
            weights = [w * layout.token_mask(m.to(w.device), w) for w, m in zip(weights, masks)]
        counted = sum(int(m.sum()) * (t.numel() // m.numel()) for m, t in zip(masks, targets))
    else:
        counted = sum(t.numel() for t in targets)
    numel = sum(plan.gather([counted]))

    def f32_total(parts: list[float]) -> torch.Tensor:
        """The gathered parts summed in float32, in global order (every rank the same bits)."""
        acc = torch.zeros((), dtype=torch.float32)
        for p in parts:
            acc = acc + torch.tensor(p, dtype=torch.float32)
        return acc

    def full_mse() -> tuple[float, list[torch.Tensor]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for n, o in offs.items():  # rounded once for every batch
                soft[n].w = o.value()
            outs = run(layer, inputs)
            shared.clear()
            for n in offs:
                soft[n].w = None
            total = f32_total(plan.gather([float(weighted_se(o, t, w).sum()) for o, t, w in zip(outs, targets, weights)]))
        rep.evals += 1
        rep.eval_calls += len(inputs)
        rep.eval_seconds += time.perf_counter() - t0
        return float(total / numel), outs

    def window_se(outs: list[torch.Tensor], atoms) -> list[float]:
        """The summed weighted squared error of each of ``atoms`` (this rank's) in ``outs``."""
        out = []
        for a in atoms:
            o = outs[a.batch]
            if a.rows is not None:
                o = o[a.rows] if layout is None else layout.cut_output(o, a.rows.start, a.rows.stop)
            _, tgt, wts = a.take(inputs, targets, weights, layout)
            out.append(float(weighted_se(o, tgt, wts).sum()))
        return out

    try:
        lr0 = options.lr if options.lr is not None else default_lr(options.iters)
        olist = list(offs.values())
        fused = frozenset(k for k, o in enumerate(olist) if o.fused)  # they round their gradient in their step
        params = [p for o in olist for p in o.params()]
        start_p = [p.detach().clone() for p in params]
        checked = options.eval_every is None  # the start is checked on step 0's windows (module docstring)
        best, best_outs, best_p = None, None, start_p
        start_check: list[float] = []  # step 0's windows' errors with the given codes (this rank's)
        check_atoms = []               # and those windows
        if checked:
            rep.mse_start = None
        else:
            best, best_outs = full_mse()
            rep.mse_start = best
            rep.history.append(best)
        with torch.enable_grad():
            for step in range(options.iters):
                t0 = time.perf_counter()
                mine = plan.atoms(step)
                if step == 0:
                    check_atoms = mine
                # rounded once a step; the atoms run on leaves (fused: the value itself, no graph)
                ws = [o.value() if o.fused else o.weight() for o in olist]
                leaves = [(w if o.fused else w.detach()).requires_grad_(True) for w, o in zip(ws, olist)]
                for n, w in zip(offs, leaves):
                    soft[n].w = w
                per_atom = []
                for atom in mine:  # each window alone: the sum below does not depend on the split
                    call, tgt, wts = atom.take(inputs, targets, weights, layout)
                    out = run(layer, [call])[0]
                    shared.clear()
                    loss = weighted_se(out, tgt, wts).sum()
                    if step == 0 and checked:
                        start_check.append(float(loss.detach()))
                    # an expert no token of this window reaches has no gradient: None, a zero
                    per_atom.append(torch.autograd.grad(loss, leaves, allow_unused=True))
                    del out, loss
                    rep.backward_calls += 1
                for n in offs:
                    soft[n].w = None
                total = plan.exact_sum(per_atom, leaves, what, defer=fused)
                del per_atom, leaves
                rep.steps += 1
                lr = lr0 * (1.0 - step / options.iters)
                rest = [k for k, o in enumerate(olist) if not o.step(total[k], lr)]  # fused: stepped
                own = [p for k in rest for p in olist[k].params()]
                outs_g = [t.value() if isinstance(t, Unrounded) else t for t in (total[k] for k in rest)]
                grads = torch.autograd.grad([ws[k] for k in rest], own, grad_outputs=outs_g, allow_unused=True) if rest else ()
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(own, grads)]
                del ws, total
                with torch.no_grad():
                    by_id = {id(p): g for p, g in zip(own, grads)}  # this step's own tensors: signed in place
                    for o in (olist[k] for k in rest):
                        o.V.sub_(by_id[id(o.V)].sign_().mul_(lr)).clamp_(-0.5, 0.5)
                        if o.c is not None:
                            o.c.sub_(by_id[id(o.c)].sign_().mul_(lr)).clamp_(min=C_MIN)
                            torch.minimum(o.c, o.c_hi, out=o.c)
                rep.step_seconds += time.perf_counter() - t0
                if step + 1 == options.iters or (options.eval_every is not None
                                                 and (step + 1) % options.eval_every == 0):
                    m, outs = full_mse()
                    rep.history.append(m)
                    if checked:  # the last step against the given codes on step 0's windows
                        rep.check_start = float(f32_total(plan.gather(start_check)))
                        rep.check_end = float(f32_total(plan.gather(window_se(outs, check_atoms))))
                        if rep.check_end < rep.check_start:
                            best, rep.best_step, best_outs, best_p = m, step + 1, outs, None
                            break
                        end_p = [p.detach().clone() for p in params]  # not better there: the whole set decides
                        with torch.no_grad():
                            for p, b in zip(params, start_p):
                                p.copy_(b)
                        best, best_outs = full_mse()
                        rep.mse_start = best
                        rep.history.insert(0, best)
                        if m < best:
                            best, rep.best_step, best_outs, best_p = m, step + 1, outs, end_p
                        break
                    if m < best:
                        best, rep.best_step, best_outs = m, step + 1, outs
                        best_p = [p.detach().clone() for p in params]
                    del outs
        if best_p is not None:  # None: the offsets hold the codes kept
            with torch.no_grad():
                for p, b in zip(params, best_p):
                    p.copy_(b)
        rep.mse_end = best
        rep.outputs = best_outs
    finally:
        for n, s in soft.items():
            set_submodule(layer, n, s.q)
        for p, req in frozen:
            p.requires_grad_(req)
    for n, o in offs.items():
        changed, scales_changed = o.store(mods[n])
        rep.changed += changed
        rep.scales_changed += scales_changed
    return rep
