"""Observers: statistics of activations that choose static scales.

An observer sees activation rows ``x [N, in]`` batch after batch (``observe``) and answers
``amax()``: the clipping value that the static scale is computed from, per tensor ([1]) or
per channel ([in], one per input column). Three kinds:

- ``MaxObserver``: the running max of |x|. Per-tensor answers are derived from per-channel
  maxima, so ``rescale(s)`` can account exactly for a later division of column j by s_j
  (SmoothQuant) without seeing the data again.
- ``PercentileObserver``: the q-th percentile of |x| (per batch, averaged over batches,
  weighted by rows), never above the running max.
- ``MSEObserver``: the clip c * max|x| (c on a grid) whose quantize-dequantize under the
  activation spec has the smallest squared error on a bounded sample of rows.

``ActivationObserver`` names these kinds (``CalibrationConfig.observer``); a weight spec's
``observer`` is a ``lowbit.schemes.WeightObserver``, whose MAX and MSE apply the same rules to
each scale group of a weight (lowbit.quant.mse_scales).
"""

from __future__ import annotations

from enum import Enum

import torch

from lowbit.quant import fake_quantize, global_scale_from_amax, scales_from_amax
from lowbit.schemes import Dynamic, Granularity, QuantSpec


class ActivationObserver(str, Enum):
    """How calibration chooses a static activation scale from the observed inputs."""

    MAX = "max"                # the running max of |x|
    PERCENTILE = "percentile"  # a high percentile of |x|
    MSE = "mse"                # the clip with the smallest quantize-dequantize error

    def __str__(self) -> str:
        return self.value


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).to(torch.float32)


class Observer:
    per_channel: bool = False

    def observe(self, x: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def amax(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def empty(self) -> bool:
        return getattr(self, "_count", 0) == 0


class MaxObserver(Observer):
    """Running max of |x| per channel; ``amax()`` per tensor or per channel."""

    def __init__(self, per_channel: bool = False) -> None:
        self.per_channel = per_channel
        self.channel_max: torch.Tensor | None = None
        self._count = 0

    def observe(self, x: torch.Tensor) -> None:
        r = _rows(x)
        if r.shape[0] == 0:
            return
        m = r.abs().amax(0)
        self.channel_max = m if self.channel_max is None else torch.maximum(self.channel_max, m)
        self._count += r.shape[0]

    def rescale(self, s: torch.Tensor) -> None:
        """The observed data divided column-wise by ``s`` (exact for a max)."""
        if self.channel_max is not None:
            self.channel_max = self.channel_max / s.to(torch.float32)

    def amax(self) -> torch.Tensor:
        if self.channel_max is None:
            raise ValueError("observer saw no data")
        return self.channel_max.clone() if self.per_channel else self.channel_max.amax().reshape(1)


class PercentileObserver(Observer):
    """The q-th percentile of |x| (per tensor, or per channel over rows)."""

    def __init__(self, q: float = 99.99, per_channel: bool = False) -> None:
        self.q = q
        self.per_channel = per_channel
        self._sum: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._count = 0

    def observe(self, x: torch.Tensor) -> None:
        r = _rows(x).abs()
        n = r.shape[0]
        if n == 0:
            return
        if self.per_channel:
            k = max(1, min(n, int(round(self.q / 100.0 * n))))
            val = r.kthvalue(k, dim=0).values
            mx = r.amax(0)
        else:
            flat = r.reshape(-1)
            k = max(1, min(flat.numel(), int(round(self.q / 100.0 * flat.numel()))))
            val = flat.kthvalue(k).values.reshape(1)
            mx = flat.amax().reshape(1)
        self._sum = val * n if self._sum is None else self._sum + val * n
        self._max = mx if self._max is None else torch.maximum(self._max, mx)
        self._count += n

    def amax(self) -> torch.Tensor:
        if self._sum is None:
            raise ValueError("observer saw no data")
        return torch.minimum(self._sum / self._count, self._max)


class MSEObserver(Observer):
    """MSE-optimal clipping for ``spec`` (an activation spec) on a bounded sample of rows.

    The candidates are c * amax for c in ``grid``; the error is that of quantize-dequantize
    with the static scale (or, for NVFP4 inputs, the global scale) the candidate gives. Per
    channel, each column gets its own clip under a per-channel version of the spec's format.
    """

    def __init__(self, spec: QuantSpec, per_channel: bool = False, max_rows: int = 2048,
                 grid: tuple[float, ...] = tuple(1.0 - 0.025 * i for i in range(21))) -> None:
        self.spec = spec
        self.per_channel = per_channel
        self.max_rows = max_rows
        self.grid = grid
        self._max = MaxObserver(per_channel=True)
        self._samples: list[torch.Tensor] = []
        self._kept = 0
        self._count = 0

    def observe(self, x: torch.Tensor) -> None:
        r = _rows(x)
        if r.shape[0] == 0:
            return
        self._max.observe(r)
        self._count += r.shape[0]
        room = self.max_rows - self._kept
        if room > 0:
            step = max(1, r.shape[0] // room)
            take = r[::step][:room]
            self._samples.append(take.clone())
            self._kept += take.shape[0]

    def _qdq(self, x: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if self.per_channel:
            cs = QuantSpec(spec.format, Granularity.CHANNEL)
            scale = scales_from_amax(clip, cs).reshape(-1, 1)
            return fake_quantize(x.t(), cs, scale=scale).t()
        if spec.global_scale:  # NVFP4 inputs: the clip sets the global scale
            return fake_quantize(x, spec, global_scale=global_scale_from_amax(clip, spec))
        ts = QuantSpec(spec.format, Granularity.TENSOR, dynamic=Dynamic.STATIC)
        return fake_quantize(x, ts, scale=scales_from_amax(clip, ts))

    def amax(self) -> torch.Tensor:
        if not self._samples:
            raise ValueError("observer saw no data")
        x = torch.cat(self._samples)
        full = self._max.amax() if self.per_channel else self._max.amax().amax().reshape(1)
        safe = torch.where(full > 0, full, torch.ones_like(full))
        best_err, best = None, full
        for c in self.grid:
            clip = safe * c
            err = (self._qdq(x, clip) - x).pow(2)
            err = err.sum(0) if self.per_channel else err.sum().reshape(1)
            if best_err is None:
                best_err, best = err, clip
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best = torch.where(better, clip, best)
        return torch.where(full > 0, best, full)


def make_observer(kind: ActivationObserver | str, spec: QuantSpec | None, *, per_channel: bool = False,
                  percentile: float = 99.99, max_rows: int = 2048) -> Observer:
    kind = ActivationObserver(kind)
    if kind is ActivationObserver.MAX:
        return MaxObserver(per_channel)
    if kind is ActivationObserver.PERCENTILE:
        return PercentileObserver(percentile, per_channel)
    if spec is None:
        raise ValueError("the mse observer needs the activation spec")
    return MSEObserver(spec, per_channel, max_rows)
