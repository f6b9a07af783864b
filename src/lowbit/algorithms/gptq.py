"""GPTQ weight rounding (Frantar et al., 2022): pure functions on tensors.

Round-to-nearest quantizes every weight on its own. GPTQ quantizes the columns (input
features) of W [out, in] one after another and spreads each column's rounding error over the
columns not yet quantized, weighted by the inverse Hessian of the layer's squared output error
``H = sum_x x^T x`` over calibration inputs, so that ``||X W^T - X Q^T||`` shrinks, not
``||W - Q||``.

The scales are NOT re-fitted: they are computed up front by ``lowbit.quant.quantize(W, spec)``
(whatever scale rule the spec defines; NVFP4's global scale as given, so that fused siblings
keep sharing it; with ``scale_search``, the candidates of the spec's searched rule,
``lowbit.quant.mse_scales.searching``, scored by the squared weight error weighted by each input
column's Hessian diagonal) and stay fixed, so the result is a ``QuantizedTensor`` of exactly the structure
round-to-nearest produces and every backend and file format takes it unchanged. Its codes are
``quantize(Q, spec, scale=..., global_scale=...)`` of the GPTQ-rounded weights Q.

Steps (H summed and damped in float64; factorization and updates in float32, as in the
reference GPTQ code):
1. dead inputs (H[i, i] == 0): the column of W is set to zero and H[i, i] to 1;
2. act_order (optional): columns are visited by decreasing H[i, i] (each still uses its own
   group's scale, fixed up front);
3. damping: H += damp * mean(diag H) * I (raised tenfold up to 4 times if Cholesky fails);
4. U = upper Cholesky factor of H^-1; for each column j in blocks of ``block_size``:
   q_j = qdq(w_j) with its fixed scale, e = (w_j - q_j) / U[j, j],
   w_k -= e * U[j, k] for k > j (inside the block at once, the rest lazily per block)
   (``lowbit.algorithms.gptq_solve``, where the fused groups of one layer share the loop).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics import get_format
from lowbit.algorithms.gptq_solve import solve_columns
from lowbit.quant.groups import group_view
from lowbit.quant.mse_scales import search_scales, searching
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.quant.qdq import effective_scale, quantize
from lowbit.schemes import Granularity, QuantSpec


class WeightRounding(str, Enum):
    """How calibrated quantization rounds weights."""

    RTN = "rtn"    # round to nearest, every weight on its own
    GPTQ = "gptq"  # error-compensating rounding with the input Hessian

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GPTQOptions:
    """damping: fraction of the mean Hessian diagonal added to the diagonal.
    block_size: columns per lazy batch update (numerics barely depend on it; speed does).
    act_order: visit columns by decreasing Hessian diagonal (scales stay the up-front ones).
    scale_search: the up-front scales are searched per group among the candidates of the spec's
    searched rule (``lowbit.quant.mse_scales.searching``: full-range -> full-range-mse, max and
    mse -> mse, started from the closed-form rule) for the smallest squared weight error
    weighted by each input column's Hessian diagonal (an error counts by the energy of the input
    it multiplies: SmolLM2 w4a16, GPTQ + 20 steps, +8.60% unweighted, +6.03% weighted); off, the
    up-front scales are RTN's (``quantize(W, spec)``, the spec's own observer). The spec itself,
    and so every file, is unchanged.
    max_batch_bytes: the memory one column loop may hold (float32 weights of its groups plus their
    distinct inverse-Hessian factors); groups of one width are batched up to it (at least one).
    MoE experts that share one Hessian share its factor."""

    damping: float = 0.01
    block_size: int = 128
    act_order: bool = False
    scale_search: bool = False
    max_batch_bytes: int = 1 << 30  # groups solved together: their float32 weights and distinct factors

    def __post_init__(self) -> None:
        if not (isinstance(self.damping, (int, float)) and 0.0 < float(self.damping) <= 1.0):
            raise QuantizationError(f"gptq damping must be in (0, 1], got {self.damping!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise QuantizationError(f"gptq block_size must be a positive integer, got {self.block_size!r}")
        if isinstance(self.max_batch_bytes, bool) or not isinstance(self.max_batch_bytes, int) or \
                self.max_batch_bytes < 1:
            raise QuantizationError(f"gptq max_batch_bytes must be a positive integer, got {self.max_batch_bytes!r}")


def _column_scales(qt: QuantizedTensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(effective scale, divisor) of every weight element, transposed: [in, out] each (the
    divisor is the scale, 1 where the scale is 0: an all-zero group). Made from the per-group
    scales without an [out, in] intermediate; per-channel and per-tensor ones are expanded
    views."""
    spec = qt.spec
    eff = effective_scale(qt.scale, spec, qt.global_scale).to(torch.float32)
    div = torch.where(eff != 0, eff, torch.ones((), dtype=torch.float32))
    out = qt.codes.shape[0]
    if spec.granularity in (Granularity.GROUP, Granularity.BLOCK):  # [out, G] -> [G * g, out] -> [in, out]
        g = spec.group_size
        return tuple(t.t().repeat_interleave(g, dim=0)[:in_features] for t in (eff, div))
    return tuple(t.reshape(1, -1).expand(in_features, out) for t in (eff, div))  # CHANNEL [out, 1], TENSOR [1]


def inverse_hessian_factor(H: torch.Tensor, damping: float, name: str = "weight",
                           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping * mean(diag H) * I)^-1 (U^T U = H^-1), computed
    and returned in ``dtype`` (H: dead columns already fixed; the damping is added in float64).
    Only the upper triangle and the diagonal of H are read. The damping is raised tenfold (up
    to 4 times) if H is not positive definite.

    With J the reversal permutation and L the lower Cholesky factor of J H J: H^-1 = J L^-T L^-1 J
    = U^T U for U = J L^-1 J, upper triangular with a positive diagonal, so one Cholesky and one
    triangular inverse replace Cholesky, inverse from Cholesky and a second Cholesky."""
    diag = torch.diagonal(H).to(torch.float64)
    mean_diag = float(diag.mean())
    if mean_diag <= 0:
        mean_diag = 1.0
    d = damping
    flipped = H.to(dtype).flip(0, 1)  # converted, then flipped: the smaller copy
    for _ in range(5):
        # the damped diagonal is summed in float64 and rounded once to dtype
        flipped.diagonal().copy_((diag + d * mean_diag).flip(0))
        L, info = torch.linalg.cholesky_ex(flipped)  # reads the lower triangle: H's upper one
        if int(info) == 0:
            inv = torch.zeros_like(L)
            _lower_triangular_inverse(L, inv)
            if bool(torch.isfinite(inv.sum())) or bool(torch.isfinite(inv).all()):  # sum: one pass
                return inv.flip(0, 1)
        d *= 10.0
    raise QuantizationError(f"gptq: the Hessian of {name!r} is not positive definite even with damping {d / 10:g}")


def _lower_triangular_inverse(L: torch.Tensor, out: torch.Tensor, base: int = 128) -> None:
    """Write L^-1 of a lower triangular L with a nonzero diagonal into the lower triangle of
    ``out`` (its strict upper triangle is not touched), by halves: [[A, 0], [B, C]]^-1 =
    [[A^-1, 0], [-C^-1 B A^-1, C^-1]] (n^3 / 3 multiply-adds, where a triangular solve against
    the identity does n^3)."""
    n = L.shape[0]
    if n <= base:
        out.copy_(torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False))
        return
    h = n // 2
    _lower_triangular_inverse(L[:h, :h], out[:h, :h], base)
    _lower_triangular_inverse(L[h:, h:], out[h:, h:], base)
    torch.matmul(out[h:, h:], L[h:, :h] @ out[:h, :h], out=out[h:, :h])
    out[h:, :h].neg_()


def _check(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, name: str, first: bool = True) -> None:
    """Shapes and spec of one weight; the values of H only for the ``first`` weight reading it."""
    if W.dim() != 2:
        raise QuantizationError(f"gptq: weight {name!r} must be 2-D [out, in], got shape {tuple(W.shape)}")
    in_f = W.shape[1]
    if tuple(H.shape) != (in_f, in_f):
        raise QuantizationError(f"gptq: Hessian of {name!r} has shape {tuple(H.shape)}, expected ({in_f}, {in_f})")
    if not spec.symmetric:
        raise QuantizationError(f"gptq: weight {name!r}: asymmetric weight specs ({spec.describe()}) are not supported")
    if first and not bool(torch.isfinite(H.sum())) and not bool(torch.isfinite(H).all()):  # sum: one pass
        raise QuantizationError(f"gptq: Hessian of {name!r} has NaN/Inf values")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, *, global_scale: torch.Tensor | None = None,
                  options: GPTQOptions = GPTQOptions(), name: str = "weight") -> QuantizedTensor:
    """GPTQ-round ``W`` [out, in] under ``spec`` given the input Hessian ``H`` [in, in] (symmetric:
    only its upper triangle and diagonal are read, so the upper triangle alone, e.g.
    ``HessianSum.upper()``, will do).

    Returns the QuantizedTensor RTN would produce with the same scales (``quantize(W, spec,
    global_scale=global_scale)``'s scale / global scale; with ``options.scale_search``, the
    Hessian-weighted search's, ``_up_front``), with GPTQ codes, under ``spec``.
    """
    return gptq_quantize_shared([W], H, spec, global_scales=[global_scale], options=options, names=[name])[0]


def gptq_quantize_shared(Ws: list[torch.Tensor], H: torch.Tensor, spec: QuantSpec, *,
                         global_scales: list[torch.Tensor | None] | None = None,
                         options: GPTQOptions = GPTQOptions(), names: list[str] | None = None) -> list[QuantizedTensor]:
    """``gptq_quantize`` of several weights that read the same input (q/k/v, gate/up: one
    Hessian), solved as one stacked matrix (rows are independent in GPTQ, so this equals
    separate solves up to float32 summation order); each keeps its own scales."""
    return gptq_quantize_groups([Ws], [H], spec, global_scales=[global_scales] if global_scales else None,
                                options=options, names=[names] if names else None)[0]


def gptq_quantize_groups(groups: list[list[torch.Tensor]], Hs: list[torch.Tensor], spec: QuantSpec, *,
                         global_scales: list[list[torch.Tensor | None]] | None = None,
                         options: GPTQOptions = GPTQOptions(),
                         names: list[list[str]] | None = None, workers: int = 1) -> list[list[QuantizedTensor]]:
    """``gptq_quantize_shared`` of several groups, each with its own Hessian (the fused groups
    of one decoder layer). Without act_order, groups of the same input width share one column
    loop (``lowbit.algorithms.gptq_solve``): the same numbers as separate solves up to float32
    summation order, in fewer (larger) operations. ``workers`` > 1: that many column-loop batches
    (``gptq_batches``) are solved at once, each on its own thread (the caller keeps torch at one
    intra-op thread, ``lowbit.threads.one_thread``: the loops are many small operations); each
    batch's numbers do not depend on the others', so the result is the same bits."""
    names = names or [[f"group{g}.weight{i}" for i in range(len(Ws))] for g, Ws in enumerate(groups)]
    global_scales = global_scales or [[None] * len(Ws) for Ws in groups]
    for Ws, H, ns in zip(groups, Hs, names):
        for i, (W, n) in enumerate(zip(Ws, ns)):
            _check(W, H, spec, n, first=i == 0)
    out: list[list[QuantizedTensor]] = [[] for _ in groups]
    batches = gptq_batches(groups, Hs, options)  # a batch's inverse Hessian factors are alive together

    def solve(ks: list[int]) -> None:
        parts, perms, rtns, scales = [], [], {}, []
        factors: dict[int, tuple] = {}  # id(H) -> its factor: groups given one Hessian share it
        for k in ks:
            Ws = [W.detach().to(torch.float32) for W in groups[k]]
            rtns[k] = [_up_front(W, spec, options.scale_search, g, n, Hs[k])
                       for W, g, n in zip(Ws, global_scales[k], names[k])]
            W, u, perm = prepare_part(torch.cat(Ws), Hs[k], options, names[k][0], factors)
            for r in rtns[k]:
                eff_t, div_t = _column_scales(r, W.shape[1])
                scales.append((eff_t, div_t) if perm is None else (eff_t[perm], div_t[perm]))
            parts.append((W, u))
            perms.append(perm)
        if all(e.stride(0) == 0 and d.stride(0) == 0 for e, d in scales):  # per channel: one row each
            in_f = scales[0][0].shape[0]
            eff_t = torch.cat([e[0] for e, _ in scales]).expand(in_f, -1)
            div_t = torch.cat([d[0] for _, d in scales]).expand(in_f, -1)
        else:
            eff_t = torch.cat([e for e, _ in scales], dim=1)
            div_t = torch.cat([d for _, d in scales], dim=1)
        del scales
        qs = solve_columns(parts, eff_t, div_t, get_format(spec.format), options.block_size)
        del parts, eff_t, div_t
        for k, Q, perm in zip(ks, qs, perms):
            if perm is not None:
                Q = Q[:, torch.argsort(perm)]
            r0 = 0
            for r, n in zip(rtns[k], names[k]):
                q = Q[r0:r0 + r.codes.shape[0]]
                r0 += r.codes.shape[0]
                out[k].append(quantize(q, spec, scale=r.scale, global_scale=r.global_scale, name=n))

    if workers > 1 and len(batches) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(batches))) as pool:
            for f in [pool.submit(solve, ks) for ks in batches]:
                f.result()  # in order: the first error is raised
    else:
        for ks in batches:
            solve(ks)
    return out


def _up_front(W: torch.Tensor, spec: QuantSpec, search: bool, global_scale, name: str,
              H: torch.Tensor) -> QuantizedTensor:
    """RTN of ``W`` on GPTQ's up-front scales: RTN's own (``quantize(W, spec)``, whatever its
    observer), or with ``search`` (where ``searching(spec)`` searches) the candidate of the
    searched rule per group, started from the closed-form rule's scale (max for mse, full-range
    for full-range-mse), with the smallest squared error weighted by each input column's Hessian
    diagonal (the energy of the input it multiplies)."""
    scale_spec = searching(spec) if search else spec
    if not search or not scale_spec.observer.searches:
        return quantize(W, spec, global_scale=global_scale, name=name)
    base = quantize(W, dataclasses.replace(scale_spec, observer=scale_spec.observer.rule),
                    global_scale=global_scale, name=name)
    v = group_view(W, spec, name)
    h = torch.diagonal(H).detach().to(torch.float32).clamp_min(0.0)
    wts = group_view(h.expand_as(W), spec, name)
    s, _ = search_scales(v, scale_spec, base.scale.to(torch.float32), None, base.global_scale, wts)
    return quantize(W, spec, scale=s, global_scale=base.global_scale, name=name)


def gptq_batches(groups: list[list[torch.Tensor]], Hs: list, options: GPTQOptions) -> list[list[int]]:
    """Group indices solved in one column loop: the groups of one input width (each alone under
    act_order), in order, split where the batch would exceed ``options.max_batch_bytes``. Groups
    whose ``Hs`` entries are one object share one Hessian (only identities are read). Solving a
    batch alone (``gptq_quantize_groups`` of exactly its groups) gives the numbers it gets here."""
    by_width: dict[int, list[int]] = {}
    for k, Ws in enumerate(groups):
        by_width.setdefault(Ws[0].shape[1] if not options.act_order else -1 - k, []).append(k)
    out: list[list[int]] = []
    for ks in by_width.values():
        batch: list[int] = []
        size, seen = 0, set()
        for k in ks:
            in_f = groups[k][0].shape[1]
            add = sum(W.shape[0] for W in groups[k]) * in_f * 4 + (0 if id(Hs[k]) in seen else in_f * in_f * 4)
            if batch and size + add > options.max_batch_bytes:
                out.append(batch)
                batch, size, seen = [], 0, set()
                add = sum(W.shape[0] for W in groups[k]) * in_f * 4 + in_f * in_f * 4
            batch.append(k)
            size += add
            seen.add(id(Hs[k]))
        out.append(batch)
    return out


def prepare_part(W: torch.Tensor, H: torch.Tensor, options: GPTQOptions, name: str,
                  factors: dict[int, tuple] | None = None):
    """(W, -Ub, perm) for ``solve_columns``: dead inputs (H[i, i] == 0) zeroed in W with
    H[i, i] = 1, columns permuted by decreasing H[i, i] under act_order (perm, else None).
    ``factors`` caches (dead, perm, -Ub) by the Hessian's identity."""
    key = id(H)
    if factors is not None and key in factors:
        dead, perm, u = factors[key]
        if bool(dead.any()):
            W = W.clone()
            W[:, dead] = 0.0
        return (W if perm is None else W[:, perm]), u, perm
    H = H.detach().to(torch.float64)
    dead = torch.diagonal(H) == 0
    if bool(dead.any()):
        H = H.clone()
        H[dead, dead] = 1.0
        W = W.clone()
        W[:, dead] = 0.0
    perm = None
    if options.act_order:  # the permuted matrix needs both triangles: mirror the upper one
        H = torch.triu(H) + torch.triu(H, 1).T
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_factor(H, float(options.damping), name, dtype=torch.float32)
    u = U / (-torch.diagonal(U)).unsqueeze(1)
    if factors is not None:
        factors[key] = (dead, perm, u)
    return W, u, perm
