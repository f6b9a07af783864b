"""What one calibration run observes and reports: a fused group's input statistics during a
layer pass (``GroupStats``), and the report left on the model (``CalibrationReport``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.calibration.cost import CalibrationCost
from lowbit.calibration.hessian import HessianSum
from lowbit.calibration.observers import MaxObserver, Observer


@dataclass
class GroupReport:
    members: list[str]
    amax_all: float | None = None       # max |input| over every position (after smoothing)
    amax_used: float | None = None      # the amax the static scales were computed from
    alpha: float | None = None          # SmoothQuant alpha applied to this group's input (None: none)
    alpha_errors: dict | None = None    # the search's candidates (smoothquant="auto")


@dataclass
class CalibrationReport:
    scheme: str
    num_samples: int
    seq_len: int
    sink_positions: int
    observer: str
    smoothquant: object
    smoothing_family: str | None
    weight_rounding: str = "rtn"
    layer_inputs: str = "quantized"
    gptq: dict | None = None            # GPTQ options (damping, block_size, act_order) when used
    groups: dict[str, GroupReport] = field(default_factory=dict)
    reconstruct: dict[str, dict] = field(default_factory=dict)  # per decoder layer: output MSE before/after
    seconds: float = 0.0
    data: dict | None = None            # what it ran on (lowbit.calibration.inputs.CalibrationInfo.as_dict)
    cost: CalibrationCost = field(default_factory=CalibrationCost)  # seconds and layer passes per phase
    unsmoothed: dict[str, dict[str, str]] = field(default_factory=dict)  # per layer: source -> why not folded


def masked_rows(x: torch.Tensor, valid: torch.Tensor, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of x at the valid positions, rows at the valid positions from ``sinks`` on) of x
    [B, T, in] or [B * T, in] under ``valid`` [B, T]."""
    v = valid.to(x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] != v.numel():
        raise RuntimeError(f"an input of {rows.shape[0]} positions under a validity mask of {v.numel()}")
    keep = v.reshape(-1)
    scale = keep
    if sinks:
        after = torch.arange(v.shape[-1], device=x.device) >= sinks
        scale = (v & after).reshape(-1)
    return rows[keep], rows[scale]


class GroupStats:
    """Statistics of one fused group's (shared) input during one layer pass."""

    def __init__(self, scale_observer: Observer | None, sample_rows: int, hessian: bool = False,
                 deferred_hessian: bool = False) -> None:
        self.all_pos = MaxObserver(per_channel=True)     # every position
        self._hessian = HessianSum(deferred_hessian) if hessian else None  # sum x^T x over every position
        self.scale_chan = MaxObserver(per_channel=True)  # positions that set static scales
        self.scale_obs = scale_observer
        self.sample_rows = sample_rows
        self.samples: list[torch.Tensor] = []
        self._kept = 0

    def observe(self, x: torch.Tensor, sinks: int, seq_len: int = 0, valid: torch.Tensor | None = None) -> None:
        """Observe one batch's input x [B, T, in] (or [B * T, in]: MoE experts see the flattened
        windows, every token); ``valid`` [B, T] (bool): the positions that count (padding is
        left out of every statistic; None: all)."""
        if valid is not None:
            x, xs = masked_rows(x, valid, sinks)
        else:
            if sinks and x.dim() == 2 and seq_len and x.shape[0] % seq_len == 0:
                x = x.reshape(-1, seq_len, x.shape[-1])
            xs = x[..., sinks:, :] if sinks and x.dim() >= 3 else x
        self.all_pos.observe(x)
        if self._hessian is not None:
            self._hessian.add(x)
        self.scale_chan.observe(xs)
        if self.scale_obs is not None and not isinstance(self.scale_obs, MaxObserver):
            self.scale_obs.observe(xs)
        if self.sample_rows:
            r = xs.reshape(-1, xs.shape[-1]).to(torch.float32)
            room = self.sample_rows - self._kept
            if room > 0 and r.shape[0]:
                take = r[:: max(1, r.shape[0] // room)][:room].clone()
                self.samples.append(take)
                self._kept += take.shape[0]

    def rescale(self, s: torch.Tensor) -> bool:
        """Account for a division of the input by s; False when the observer must see data again."""
        self.all_pos.rescale(s)
        self.scale_chan.rescale(s)
        self.samples = [t / s for t in self.samples]
        if self._hessian is not None:
            self._hessian.rescale(1.0 / s.to(torch.float64))
        return self.scale_obs is None or isinstance(self.scale_obs, MaxObserver)

    @property
    def hessian_sum(self) -> HessianSum | None:
        """The running sum itself (for combining ranks, ``lowbit.calibration.reduce``)."""
        return self._hessian

    @property
    def hessian(self) -> torch.Tensor | None:
        """sum x^T x over every position seen (float64), None without Hessian tracking or data."""
        return None if self._hessian is None else self._hessian.value()

    @property
    def hessian_upper(self) -> torch.Tensor | None:
        """``hessian``'s upper triangle and diagonal (below: zero or mirrored; not a copy): all
        GPTQ reads."""
        return None if self._hessian is None else self._hessian.upper()

    def scale_amax(self) -> torch.Tensor:
        if self.scale_obs is None or isinstance(self.scale_obs, MaxObserver):
            return self.scale_chan.amax().amax().reshape(1)
        return self.scale_obs.amax().reshape(-1).amax().reshape(1)
