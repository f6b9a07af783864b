"""GPTQ weight rounding (Frantar et al., 2022): pure functions on tensors.

Round-to-nearest quantizes every weight on its own. GPTQ quantizes the columns (input
features) of W [out, in] one after another and spreads each column's rounding error over the
columns not yet quantized, weighted by the inverse Hessian of the layer's squared output error
``H = sum_x x^T x`` over calibration inputs, so that ``||X W^T - X Q^T||`` shrinks, not
``||W - Q||``.

The scales are NOT re-fitted: they are computed up front by ``lowbit.quant.quantize(W, spec)``
(whatever scale rule the spec defines; NVFP4's global scale as given, so that fused siblings
keep sharing it) and stay fixed, so the result is a ``QuantizedTensor`` of exactly the structure
round-to-nearest produces and every backend and file format takes it unchanged. Its codes are
``quantize(Q, spec, scale=..., global_scale=...)`` of the GPTQ-rounded weights Q.

Steps (float64 Cholesky, float32 updates):
1. dead inputs (H[i, i] == 0): the column of W is set to zero and H[i, i] to 1;
2. act_order (optional): columns are visited by decreasing H[i, i] (each still uses its own
   group's scale, fixed up front);
3. damping: H += damp * mean(diag H) * I (raised tenfold up to 4 times if Cholesky fails);
4. U = upper Cholesky factor of H^-1; for each column j in blocks of ``block_size``:
   q_j = qdq(w_j) with its fixed scale, e = (w_j - q_j) / U[j, j],
   w_k -= e * U[j, k] for k > j (inside the block at once, the rest lazily per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics import get_format
from lowbit.quant.nearest import column_rounder
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.quant.scaling import effective_scale, quantize
from lowbit.schemes import Granularity, QuantSpec


class WeightRounding(str, Enum):
    """How calibrated quantization rounds weights."""

    RTN = "rtn"    # round to nearest, every weight on its own
    GPTQ = "gptq"  # error-compensating rounding with the input Hessian

    def __str__(self) -> str:
        return self.value


# columns updated one by one inside a block before a matrix update of the rest of the block:
# keeps the per-column updates small (single-threaded, cache-resident); the result differs
# from a column-by-column update of the whole block only in float32 summation order
_SUB = 16


@dataclass(frozen=True)
class GPTQOptions:
    """damping: fraction of the mean Hessian diagonal added to the diagonal.
    block_size: columns per lazy batch update (numerics barely depend on it; speed does).
    act_order: visit columns by decreasing Hessian diagonal (scales stay the up-front ones)."""

    damping: float = 0.01
    block_size: int = 128
    act_order: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.damping, (int, float)) and 0.0 < float(self.damping) <= 1.0):
            raise QuantizationError(f"gptq damping must be in (0, 1], got {self.damping!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise QuantizationError(f"gptq block_size must be a positive integer, got {self.block_size!r}")


def _column_scales(qt: QuantizedTensor, in_features: int) -> torch.Tensor:
    """The effective scale of every weight element [out, in] (0 where the group is all zero)."""
    spec = qt.spec
    eff = effective_scale(qt.scale, spec, qt.global_scale).to(torch.float32)
    out = qt.codes.shape[0]
    if spec.granularity is Granularity.GROUP:
        g = spec.group_size
        return eff.repeat_interleave(g, dim=-1)[:, :in_features].expand(out, in_features)
    return eff.reshape(-1, 1).expand(out, in_features)  # CHANNEL [out, 1] or TENSOR [1]


def inverse_hessian_factor(H: torch.Tensor, damping: float, name: str = "weight",
                           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping * mean(diag H) * I)^-1 (U^T U = H^-1), computed
    and returned in ``dtype`` (H: dead columns already fixed; the damping is added in float64).
    The damping is raised tenfold (up to 4 times) if H is not positive definite.

    With J the reversal permutation and L the lower Cholesky factor of J H J: H^-1 = J L^-T L^-1 J
    = U^T U for U = J L^-1 J, upper triangular with a positive diagonal, so one Cholesky and one
    triangular inverse replace Cholesky, inverse from Cholesky and a second Cholesky."""
    H = H.to(torch.float64)
    n = H.shape[0]
    mean_diag = float(torch.diagonal(H).mean())
    if mean_diag <= 0:
        mean_diag = 1.0
    d = damping
    for _ in range(5):
        damped = H.flip(0, 1)
        damped.diagonal().add_(d * mean_diag)
        L, info = torch.linalg.cholesky_ex(damped.to(dtype))
        del damped
        if int(info) == 0:
            inv = torch.zeros_like(L)
            _lower_triangular_inverse(L, inv)
            if bool(torch.isfinite(inv).all()):
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


def _check(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, name: str) -> None:
    if W.dim() != 2:
        raise QuantizationError(f"gptq: weight {name!r} must be 2-D [out, in], got shape {tuple(W.shape)}")
    in_f = W.shape[1]
    if tuple(H.shape) != (in_f, in_f):
        raise QuantizationError(f"gptq: Hessian of {name!r} has shape {tuple(H.shape)}, expected ({in_f}, {in_f})")
    if not spec.symmetric:
        raise QuantizationError(f"gptq: weight {name!r}: asymmetric weight specs ({spec.describe()}) are not supported")
    if not bool(torch.isfinite(H).all()):
        raise QuantizationError(f"gptq: Hessian of {name!r} has NaN/Inf values")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, *, global_scale: torch.Tensor | None = None,
                  options: GPTQOptions = GPTQOptions(), name: str = "weight") -> QuantizedTensor:
    """GPTQ-round ``W`` [out, in] under ``spec`` given the input Hessian ``H`` [in, in].

    Returns the QuantizedTensor RTN would produce with the same scales (``quantize(W, spec,
    global_scale=global_scale)``'s scale / global scale), with GPTQ codes.
    """
    return gptq_quantize_shared([W], H, spec, global_scales=[global_scale], options=options, names=[name])[0]


def gptq_quantize_shared(Ws: list[torch.Tensor], H: torch.Tensor, spec: QuantSpec, *,
                         global_scales: list[torch.Tensor | None] | None = None,
                         options: GPTQOptions = GPTQOptions(), names: list[str] | None = None) -> list[QuantizedTensor]:
    """``gptq_quantize`` of several weights that read the same input (q/k/v, gate/up: one
    Hessian), solved as one stacked matrix (rows are independent in GPTQ, so this equals
    separate solves up to float32 summation order); each keeps its own scales."""
    names = names or [f"weight{i}" for i in range(len(Ws))]
    global_scales = global_scales or [None] * len(Ws)
    for W, n in zip(Ws, names):
        _check(W, H, spec, n)
    Ws = [W.detach().to(torch.float32) for W in Ws]
    rtns = [quantize(W, spec, global_scale=g, name=n) for W, g, n in zip(Ws, global_scales, names)]
    eff = torch.cat([_column_scales(r, W.shape[1]) for r, W in zip(rtns, Ws)])
    Q = _solve(torch.cat(Ws), H, eff, spec, options, names[0])
    out, r0 = [], 0
    for W, r, n in zip(Ws, rtns, names):
        q = Q[r0:r0 + W.shape[0]]
        r0 += W.shape[0]
        out.append(quantize(q, spec, scale=r.scale, global_scale=r.global_scale, name=n))
    return out


def _solve(W: torch.Tensor, H: torch.Tensor, eff: torch.Tensor, spec: QuantSpec, options: GPTQOptions,
           name: str) -> torch.Tensor:
    """The GPTQ-rounded (dequantized) weights [out, in] for fixed effective scales ``eff``.

    Works on transposed copies [in, out], so that a column of W is a contiguous row, with the
    rows of U divided by their diagonal (Ub = diag(U)^-1 U): the update of column k by column j
    is then w_k -= (w_j - q_j) * Ub[j, k], and the lazy block updates take the differences
    w_j - q_j as they are. A zero effective scale (all-zero group) gives q = round(w) * 0 = 0."""
    out_f, in_f = W.shape
    Wt = W.t().contiguous()
    H = H.detach().to(torch.float64).clone()
    dead = torch.diagonal(H) == 0
    if bool(dead.any()):
        H[dead, dead] = 1.0
        Wt[dead] = 0.0
    eff_t = eff.t()
    perm = None
    if options.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        Wt, H, eff_t = Wt[perm], H[perm][:, perm], eff_t[perm]
    U = inverse_hessian_factor(H, float(options.damping), name).to(torch.float32)
    del H
    neg_ub = U / (-torch.diagonal(U)).unsqueeze(1)  # -Ub
    del U
    eff_t = eff_t.to(torch.float32).contiguous()
    div_rows = torch.where(eff_t != 0, eff_t, torch.ones((), dtype=torch.float32)).unbind(0)
    eff_rows = eff_t.unbind(0)
    y, round_ = column_rounder(get_format(spec.format), out_f)

    Qt = torch.empty_like(Wt)
    q_rows = Qt.unbind(0)
    bs = options.block_size
    for i1 in range(0, in_f, bs):
        i2 = min(i1 + bs, in_f)
        W1 = Wt[i1:i2]
        w_rows = W1.unbind(0)
        E1 = torch.empty_like(W1)
        e_rows = E1.unbind(0)
        U1 = neg_ub[i1:i2, i1:i2]
        for s1 in range(0, i2 - i1, _SUB):
            s2 = min(s1 + _SUB, i2 - i1)
            for i in range(s1, s2):
                j = i1 + i
                w = w_rows[i]
                torch.div(w, div_rows[j], out=y)
                q = torch.mul(round_(), eff_rows[j], out=q_rows[j])
                e = torch.sub(w, q, out=e_rows[i])
                if i + 1 < s2:
                    W1[i + 1:s2].addr_(U1[i, i + 1:s2], e)
            if s2 < i2 - i1:
                W1[s2:].addmm_(U1[s1:s2, s2:].t(), E1[s1:s2])
        if i2 < in_f:
            Wt[i2:].addmm_(neg_ub[i1:i2, i2:].t(), E1)
    if perm is not None:
        Qt = Qt[torch.argsort(perm)]
    return Qt.t().contiguous()
