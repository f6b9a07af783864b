"""The tensor algebra of a fused rotation: pure functions, computed in float64 and returned in the
input's dtype.

Convention: a linear computes y = x W^T + b with W [out, in]; the residual stream h (a row) is
rotated to h Q with Q orthonormal. Then
- a linear reading the stream keeps y when W <- W Q (``rotate_inputs``);
- a linear writing the stream writes y Q when W <- Q^T W, b <- b Q (``rotate_outputs``, ``rotate_bias``);
- an embedding table's rows are stream vectors: E <- E Q (``rotate_inputs`` on E);
- an RMSNorm y = rms(h) * g over the stream commutes with Q only with g = 1, so g is first folded
  into the linears that read it: W <- W diag(g) (``fold_gain``).
Per attention head (R2, a Hadamard H of order head_dim on each head): v_proj's rows of each head
W_v <- H^T W_v (its output per head becomes v H), o_proj's columns of each head W_o <- W_o H.
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError


def _back(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.to(like.dtype).contiguous()


def fold_gain(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """W diag(g): a norm's per-channel gain g [in] folded into the weight W [out, in] reading it."""
    if g.dim() != 1 or w.shape[-1] != g.numel():
        raise QuantizationError(f"gain of shape {tuple(g.shape)} does not match a weight of {w.shape[-1]} "
                                f"input columns")
    return _back(w.double() * g.double().reshape(1, -1), w)


def rotate_inputs(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """W Q for W [out, in] (or an embedding table [vocab, in]) and Q [in, in]."""
    return _back(w.double() @ q.double(), w)


def rotate_outputs(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q^T W for W [out, in] and Q [out, out]."""
    return _back(q.double().t() @ w.double(), w)


def rotate_bias(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """b Q for a bias b [out] of a linear whose outputs are rotated by Q [out, out]."""
    return _back(b.double() @ q.double(), b)


def _per_head(n: int, h: torch.Tensor, what: str) -> int:
    d = h.shape[0]
    if n % d:
        raise QuantizationError(f"{what}: {n} is not a whole number of heads of size {d}")
    return n // d


def rotate_head_outputs(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """H^T W_head for each head's block of rows of W [heads * d, in] (H [d, d])."""
    heads = _per_head(w.shape[0], h, "rows")
    x = w.double().reshape(heads, h.shape[0], -1)
    return _back(torch.matmul(h.double().t(), x).reshape(w.shape), w)


def rotate_head_bias(b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """b_head H for each head's block of a bias b [heads * d]."""
    heads = _per_head(b.shape[0], h, "bias")
    return _back((b.double().reshape(heads, -1) @ h.double()).reshape(b.shape), b)


def rotate_head_inputs(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """W_head H for each head's block of columns of W [out, heads * d] (H [d, d])."""
    heads = _per_head(w.shape[1], h, "columns")
    x = w.double().reshape(w.shape[0], heads, h.shape[0])
    return _back(torch.matmul(x, h.double()).reshape(w.shape), w)
