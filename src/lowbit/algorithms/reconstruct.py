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
min(1 / iters, 0.02), decaying linearly to 0), each on the next ``batch_size`` calibration windows
in turn (the windows of each calibration batch in order, then the next batch; None: one whole
calibration batch per step). The codes of the best
step seen (measured on the whole calibration set every ``eval_every`` steps, and at the start)
are kept: the result is never worse than the codes it started from on the calibration data.
Deterministic: no sampling.
Memory: one layer's float copy, the offsets, the targets (one layer output per batch) and the
outputs of the best evaluation (``ReconstructReport.outputs``: the layer's outputs with the codes
kept, computed exactly as the reference backend computes them, so that a caller whose backends
match the reference can take them as the next layer's inputs instead of running the layer again).

Cost (``ReconstructReport``'s counters): ``iters`` forward + backward passes of one step's windows each,
and ``iters // eval_every + 1`` (plus one when ``iters`` is not a multiple) forward passes over
every batch. Sibling linears reading one input (q/k/v, gate/up) quantize it once per forward
(``lowbit.backends.shared_input``), and the rounded weights of fixed scales are one autograd
function (``lowbit.algorithms.reconstruct_offsets``), bit-identical to the plain expression.

Symmetric element formats only (INT, FP4/FP6/FP8); asymmetric INT specs (zero points) are refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.algorithms.reconstruct_offsets import C_MIN, Offsets
from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.calls import slice_call
from lowbit.quant import fake_quantize

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
    eval_every: int = 10             # steps between full-set evaluations (the best is kept)
    batch_size: int | None = None    # calibration windows per step (None: one calibration batch per step)
    scales: bool = False             # also tune each per-channel / per-group scale (see Offsets.scale)


@dataclass
class ReconstructReport:
    mse_start: float = 0.0           # layer output MSE with the given codes
    mse_end: float = 0.0             # with the codes kept
    changed: int = 0                 # weights whose code changed
    scales_changed: int = 0          # block scales that changed
    weights: int = 0
    best_step: int = 0
    history: list[float] = field(default_factory=list)
    steps: int = 0                   # forward + backward passes (one batch each) on this rank
    evals: int = 0                   # whole-set evaluations
    eval_calls: int = 0              # layer forward calls (one batch each) of the evaluations on this rank
    step_seconds: float = 0.0
    eval_seconds: float = 0.0
    # the layer's outputs per local batch with the codes kept (the best evaluation's), on the
    # device the layer ran on; None when nothing ran. Not part of the serialized report.
    outputs: list[torch.Tensor] | None = field(default=None, repr=False)


def _ste_input(q, x: torch.Tensor) -> torch.Tensor:
    """x (float32) QDQ'd under ``q``'s input spec, straight-through in the backward."""
    x32 = x.to(torch.float32)
    with torch.no_grad():
        xq = fake_quantize(x32, q.scheme.input_activations, scale=q.input_scale, global_scale=q.input_global_scale)
    return x32 + (xq - x32).detach()


class _SoftLinear(nn.Module):
    """A QuantLinear's forward with its weight as offsets (activations QDQ'd straight-through;
    siblings given one ``shared`` compute their common input's QDQ once)."""

    def __init__(self, q, off: Offsets, shared: SharedInput) -> None:
        super().__init__()
        self.q, self.off, self.shared = q, off, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        if q.scheme.input_activations is not None:
            x32 = self.shared.get(x, input_key(q, "reconstruct-ste"), lambda: _ste_input(q, x))
        else:
            x32 = x.to(torch.float32)
        b = None if q.bias is None else q.bias.to(torch.float32)
        return F.linear(x32, self.off.weight(), b).to(x.dtype)


class _FixedLinear(nn.Module):
    """A QuantLinear that this reconstruction does not re-round (another scheme of a mixed
    recipe): without autograd its own forward; with autograd its dequantized weight on the
    straight-through QDQ'd input, so the gradient reaches the linears before it."""

    def __init__(self, q, shared: SharedInput) -> None:
        super().__init__()
        self.q, self.shared = q, shared
        self.w = q.dequantized_weight(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        if not torch.is_grad_enabled():  # the reference numerics (the layer's backends match them or are not reused)
            from lowbit.backends.reference import ReferenceBackend

            return ReferenceBackend().forward(q, x)
        if q.scheme.input_activations is not None:
            x32 = self.shared.get(x, input_key(q, "reconstruct-ste"), lambda: _ste_input(q, x))
        else:
            x32 = x.to(torch.float32)
        b = None if q.bias is None else q.bias.to(torch.float32)
        return F.linear(x32, self.w, b).to(x.dtype)


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
    """The steps' units (a calibration batch, or ``batch_size`` windows of one) over the ranks of
    ``group`` (lowbit.dist.Group; None: one process): each rank holds a contiguous share of the
    calibration batches, in rank order, so global unit b is where one process has its unit b. One
    step's gradient is computed by the unit's owner and broadcast, and the whole-set error is
    summed in global batch order, so every rank makes the same choices as one process does, bit
    for bit."""

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
                      group=None, masks: list[torch.Tensor] | None = None) -> ReconstructReport:
    """Re-round the QuantLinears of ``layer`` named in ``float_weights`` (relative name -> the float
    weight they were quantized from; the layer's other QuantLinears keep their codes and pass the
    gradient straight through their input QDQ) to minimise the MSE of ``layer``'s outputs on ``inputs`` (the
    calibration batches, as (args, kwargs); run on ``device`` when given) against ``targets`` (one
    tensor per batch); their codes are replaced in place. ``group`` (lowbit.dist.Group): the ranks
    that each hold a contiguous share of the batches; every rank gets the codes one process holding
    all the batches would get. ``masks`` (one [B, T] bool per batch; None: every position): the
    positions whose errors count (padding weighs nothing in the loss and the MSE)."""
    from lowbit.modules import QuantLinear

    def run(m, calls):
        return _run(m, calls, device)

    # the steps' units, batch by batch: (calibration batch, its windows a:e; None: the whole batch)
    units: list[tuple[int, slice | None]] = []
    for j, t in enumerate(targets):
        n = t.shape[0]
        if options.batch_size is None or t.dim() < 3 or options.batch_size >= n:
            units.append((j, None))
        else:
            units += [(j, slice(a, min(a + options.batch_size, n))) for a in range(0, n, options.batch_size)]
    batches = _Batches(len(units), group)

    mods = {n: layer.get_submodule(n) for n in float_weights}
    offs = {n: Offsets(m, float_weights[n], options.scales) for n, m in mods.items() if isinstance(m, QuantLinear)}
    rep = ReconstructReport(weights=sum(o.w.numel() for o in offs.values()))
    if not offs or options.iters <= 0 or batches.total == 0:
        return rep
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    shared = SharedInput()
    soft: dict[str, nn.Module] = {n: _SoftLinear(mods[n], o, shared) for n, o in offs.items()}
    for n, m in layer.named_modules():  # the layer's other QuantLinears (mixed recipes): fixed
        if isinstance(m, QuantLinear) and n not in soft:
            soft[n] = _FixedLinear(m, shared)
    for n, s in soft.items():
        set_submodule(layer, n, s)

    weights = [token_weights(t) for t in targets]
    if masks is not None:
        weights = [w * m.to(w.device).reshape(w.shape[:-1]).unsqueeze(-1) for w, m in zip(weights, masks)]
        counted = sum(int(m.sum()) * t.shape[-1] for m, t in zip(masks, targets))
    else:
        counted = sum(t.numel() for t in targets)
    numel = sum(batches.gather([counted]))

    def full_mse() -> tuple[float, list[torch.Tensor]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = run(layer, inputs)
            shared.clear()
            parts = batches.gather([float(weighted_se(o, t, w).sum()) for o, t, w in zip(outs, targets, weights)])
            total = torch.zeros((), dtype=torch.float32)
            for p in parts:  # float32, in batch order
                total = total + torch.tensor(p, dtype=torch.float32)
        rep.evals += 1
        rep.eval_calls += len(inputs)
        rep.eval_seconds += time.perf_counter() - t0
        return float(total / numel), outs

    try:
        lr0 = options.lr if options.lr is not None else default_lr(options.iters)
        best, best_outs = full_mse()
        rep.mse_start = best
        rep.history.append(best)
        params = [p for o in offs.values() for p in o.params()]
        best_p = [p.detach().clone() for p in params]
        with torch.enable_grad():
            for step in range(options.iters):
                t0 = time.perf_counter()
                b = step % batches.total
                src = batches.owner(b)
                if src == batches.rank:
                    j, w = units[b - batches.first]
                    call, tgt, wts = inputs[j], targets[j], weights[j]
                    if w is not None:
                        call, tgt, wts = slice_call(call, tgt.shape[0], w.start, w.stop), tgt[w], wts[w]
                    out = run(layer, [call])[0]
                    shared.clear()
                    loss = weighted_se(out, tgt, wts).mean()
                    # an expert no token of this batch reaches has no gradient: it stays where it is
                    grads = [torch.zeros_like(p) if g is None else g.contiguous()
                             for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]
                    del out, loss
                    rep.steps += 1
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
                rep.step_seconds += time.perf_counter() - t0
                if (step + 1) % options.eval_every == 0 or step + 1 == options.iters:
                    m, outs = full_mse()
                    rep.history.append(m)
                    if m < best:
                        best, rep.best_step, best_outs = m, step + 1, outs
                        best_p = [p.detach().clone() for p in params]
                    del outs
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
        c, scale = o.result()
        c = c.to(o.qt.codes.dtype)
        rep.changed += int((c != o.qt.codes).sum())
        rep.scales_changed += int((scale != o.s0).sum())
        mods[n].weight_codes = c
        mods[n].weight_scale = scale.to(o.qt.scale.dtype)
    return rep
