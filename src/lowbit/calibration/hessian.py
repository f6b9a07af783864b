"""GPTQ's input Hessian H = sum over positions of x^T x, accumulated batch by batch.

H is symmetric, so only its upper triangle is computed: the columns are cut into blocks of
``block`` (a quarter of the width, at least 128) and block row i is x[:, i]^T x[:, i:], about
5/8 of the full product's multiply-adds for four blocks (a general matrix product has no
symmetric shortcut). Each product is float32 over one batch and is added to a float64 sum
across batches; ``value()`` mirrors the upper triangle into the full float64 matrix, ``upper()``
returns the sum as kept (GPTQ reads only the upper triangle: no mirroring, no copy).

``deferred=True`` (ranks after the first of a distributed run, ``lowbit.calibration.reduce``)
keeps each batch's float32 product instead of adding it; ``continue_from(P)`` then adds them,
in batch order, to the float64 sum P of the batches before them. Every element goes through
the same additions in the same order as in one process, so the sum is bit-identical to it.
"""

from __future__ import annotations

import torch


class HessianSum:
    def __init__(self, deferred: bool = False) -> None:
        self._upper: torch.Tensor | None = None  # float64; the lower triangle is not maintained
        self.deferred = deferred
        self.terms: list[list[torch.Tensor]] = []  # deferred: each batch's float32 block rows

    @staticmethod
    def block(n: int) -> int:
        return max(128, -(-n // 4))

    def add(self, x: torch.Tensor) -> None:
        """Add x^T x for x [..., n] (every position a row)."""
        r = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        n = r.shape[1]
        b = self.block(n)
        if self.deferred:
            self.terms.append([r[:, i:i + b].T @ r[:, i:] for i in range(0, n, b)])
            return
        if self._upper is None:
            self._upper = torch.zeros(n, n, dtype=torch.float64, device=r.device)
        for i in range(0, n, b):
            self._upper[i:i + b, i:] += (r[:, i:i + b].T @ r[:, i:]).to(torch.float64)

    def continue_from(self, prev: torch.Tensor | None, n: int) -> None:
        """The sum of the batches before this rank's (None: none) plus this rank's kept terms,
        added in order; the sum is kept (not deferred) from then on. ``n``: the input width."""
        dev = self.terms[0][0].device if self.terms else None
        acc = torch.zeros(n, n, dtype=torch.float64, device=dev) if prev is None else prev
        b = self.block(n)
        for blocks in self.terms:
            for i, blk in zip(range(0, n, b), blocks):
                acc[i:i + b, i:] += blk.to(torch.float64)
        self._upper, self.terms, self.deferred = acc, [], False

    def take(self) -> torch.Tensor | None:
        """The float64 sum as kept, handed over (this object no longer holds it)."""
        out, self._upper = self._upper, None
        return out

    def put(self, upper: torch.Tensor | None) -> None:
        self._upper = upper

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
