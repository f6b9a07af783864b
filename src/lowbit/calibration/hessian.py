"""GPTQ's input Hessian H = sum over positions of x^T x, accumulated batch by batch.

H is symmetric, so only its upper triangle is computed: the columns are cut into blocks of
``block`` (a quarter of the width, at least 128) and block row i is x[:, i]^T x[:, i:], about
5/8 of the full product's multiply-adds for four blocks (a general matrix product has no
symmetric shortcut). Each product is float32 over one batch and is added to a float64 sum
across batches; ``value()`` mirrors the upper triangle into the full float64 matrix, ``upper()``
returns the sum as kept (GPTQ reads only the upper triangle: no mirroring, no copy).
"""

from __future__ import annotations

import torch


class HessianSum:
    def __init__(self) -> None:
        self._upper: torch.Tensor | None = None  # float64; the lower triangle is not maintained

    @staticmethod
    def block(n: int) -> int:
        return max(128, -(-n // 4))

    def add(self, x: torch.Tensor) -> None:
        """Add x^T x for x [..., n] (every position a row)."""
        r = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        n = r.shape[1]
        if self._upper is None:
            self._upper = torch.zeros(n, n, dtype=torch.float64, device=r.device)
        b = self.block(n)
        for i in range(0, n, b):
            self._upper[i:i + b, i:] += (r[:, i:i + b].T @ r[:, i:]).to(torch.float64)

    def rescale(self, inv: torch.Tensor) -> None:
        """The sum of a input divided by s, given inv = 1 / s (float64): diag(inv) H diag(inv)."""
        if self._upper is not None:
            self._upper = self._upper * inv.unsqueeze(1) * inv.unsqueeze(0)

    def upper(self) -> torch.Tensor | None:
        """The float64 sum with a correct upper triangle and diagonal (what lies below the
        diagonal is zero or the mirrored value), None before any add. Not a copy."""
        return self._upper

    def value(self) -> torch.Tensor | None:
        """The full symmetric float64 sum (None before any add)."""
        if self._upper is None:
            return None
        strict = torch.triu(self._upper, 1)
        full = strict + strict.T
        full.diagonal().copy_(self._upper.diagonal())
        return full
