"""What a target is, decided per decoder layer when the whole model's forward could not be followed.

``lowbit.targets.survey_weights`` follows one forward of the model to tell matmul weights from
the rest; on the streamed path the model is on the meta device until each decoder layer is
loaded, so the kinds come from types and shapes and every parameter they cannot place (Mamba's
``A_log`` [C, N] looks like a matrix) is *deferred*. ``LayerSurvey.check`` follows the loaded
layer's own call (``param_uses.trace_call``, every expert on every token) before it is
calibrated: a deferred parameter the forward multiplies as a matrix is refused as
``check_targets`` refuses it (or, with ``allow_unquantized``, kept in float with a warning); the
others stay in float; linears whose weight the forward reads without calling them, routers
found by their top-k and linears whose outputs weight hidden vectors are not quantized (``dropped``; a warning lists the first).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from lowbit.errors import OptionRef, QuantizationError
from lowbit.param_uses import ParamKind, trace_call


@dataclass
class LayerSurvey:
    deferred: frozenset[str]                 # full parameter names decided by structure only
    allow_unquantized: bool = False
    dropped: list[str] = field(default_factory=list)      # linears left in float, full names
    unquantized: list[str] = field(default_factory=list)  # matmul weights kept in float (allow_unquantized)

    def check(self, layer: nn.Module, prefix: str, lnames: list[str], call, group=None) -> list[str]:
        """``lnames`` (full names of the layer's linears to quantize, the layer named ``prefix``)
        less the ones the layer's forward shows are not to be quantized (module docstring), read on
        ``call``, the first window of its first calibration batch on the device the layer runs on
        (``capture.first_window``; None: no batch); several ranks (``group``): rank 0 reads, every
        rank follows."""
        from lowbit.moe import all_tokens

        params = {n[len(prefix):]: layer.get_parameter(n[len(prefix):]) for n in self.deferred if n.startswith(prefix)}
        tr = None
        if call is not None:
            with all_tokens(layer):
                h = call[0][0] if call[0] else call[1].get("hidden_states")  # the stream: its width
                tr = trace_call(layer, params, lambda: layer(*call[0], **call[1]),
                                h.shape[-1] if isinstance(h, torch.Tensor) else None)
        if group is not None and group.distributed:
            tr = group.broadcast_object(tr, src=0)
        if tr is None:
            return lnames
        bad = [prefix + n for n, k in tr.kinds.items() if k is ParamKind.MATMUL]
        if bad:
            shown = ", ".join(f"{n} {list(layer.get_parameter(n[len(prefix):]).shape)}" for n in bad[:3])
            msg = f"{len(bad)} weight matrices are not nn.Linear and cannot be quantized by lowbit: {shown}"
            if not self.allow_unquantized:
                raise QuantizationError(msg + "; pass {allow} to keep them in float, or {ignore} for the modules",
                                        allow=OptionRef("allow_unquantized"), ignore=OptionRef("ignore", "NAME"))
            warnings.warn(f"lowbit: {msg}; they stay in float (allow_unquantized)", stacklevel=2)
            self.unquantized += bad
        drop = {prefix + n for n in tr.read_directly + tr.routers + tr.coefficients}
        kept = [n for n in lnames if n not in drop]
        gone = [n for n in lnames if n in drop]
        if gone:
            if not self.dropped:
                warnings.warn(f"lowbit: {gone[0]} stays in float: its weight is read without calling it, or it "
                              f"routes (more may follow, one decoder layer at a time)", stacklevel=2)
            self.dropped += gone
        return kept
