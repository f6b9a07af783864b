"""Quantize a large weight in row bands: bit-identical to quantizing it whole, in bounded memory.

Every weight scale is per row or per group of a row (BLOCK: of a tile of rows, and bands hold
whole tiles), so the bands are independent; the NVFP4
global scale is one for the whole fused group and is computed first (by the caller).
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit.quant import PackedQuantizedTensor, QuantizedTensor, quantize, quantize_into
from lowbit.schemes import Granularity, QuantSpec

#: elements quantized at once on the CPU: float32 temporaries of 4 MB that stay in cache (band sizes
#: compared in bench/modelfree/RESULTS-modelfree.md, section 3)
BAND_ELEMS = 1 << 20
#: on an accelerator: larger bands, fewer launches
DEVICE_BAND_ELEMS = 1 << 25


def quantize_rows(w: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None, name: str,
                  band_elems: int = BAND_ELEMS, pack: bool = False,
                  scratch: Callable[[int], torch.Tensor] | None = None) -> QuantizedTensor:
    """``lowbit.quant.quantize(w, spec, global_scale=...)`` computed in row bands. ``pack``: the
    layout stores the codes nibble-packed; the native path then encodes straight into packed
    bytes (a PackedQuantizedTensor; the torch path packs later, in the layout). ``scratch(n)``:
    a reusable uint8 buffer of at least n bytes for the native path's codes (the result then
    lives in it: the caller reuses it only once the result is written)."""
    rows = max(1, band_elems // max(1, w.shape[-1]))
    if spec.granularity is Granularity.BLOCK:  # bands of whole tiles: a tile's scale spans its rows
        rows = max(spec.group_size, rows // spec.group_size * spec.group_size)
    if w.dim() == 2 and spec.granularity is not Granularity.TENSOR:
        qt = _native_rows(w.contiguous(), spec, global_scale, name, rows, pack, scratch)
        if qt is not None:
            return qt
    if spec.granularity is Granularity.TENSOR or w.shape[0] <= rows:
        return quantize(w, spec, global_scale=global_scale, name=name)
    parts = [quantize(w[r:r + rows], spec, global_scale=global_scale, name=name) for r in range(0, w.shape[0], rows)]
    zp = None if parts[0].zero_point is None else torch.cat([p.zero_point for p in parts])
    return QuantizedTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), spec, zp,
                           parts[0].global_scale)


def _native_rows(w: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None, name: str,
                 rows: int, pack: bool, scratch: Callable[[int], torch.Tensor] | None = None) -> QuantizedTensor | None:
    """quantize_rows through the native kernels, each band's (packed) codes written straight into
    one buffer (no concatenation); None if a band is refused (the caller's torch path decides)."""
    if spec.global_scale and global_scale is None:
        return None  # one global scale for all bands: the caller computes it first
    pack = pack and spec.bits == 4 and w.shape[-1] % 2 == 0
    shape = (w.shape[0], w.shape[-1] // 2 if pack else w.shape[-1])
    codes = torch.empty(shape, dtype=torch.uint8) if scratch is None else scratch(shape[0] * shape[1])[
        : shape[0] * shape[1]].view(shape)
    bands = []
    for r in range(0, w.shape[0], rows):
        qt = quantize_into(w[r:r + rows], spec, global_scale=global_scale, name=name, pack=pack, out=codes[r:r + rows])
        if qt is None:
            return None
        bands.append(qt)
    gs = global_scale.reshape(1).to(torch.float32) if spec.global_scale else None
    if len(bands) == 1:
        scale, scale_codes = bands[0].scale, bands[0].known_scale_codes
    else:
        scale = torch.cat([b.scale for b in bands])
        scale_codes = None if bands[0].known_scale_codes is None else torch.cat([b.known_scale_codes for b in bands])
    return (PackedQuantizedTensor if pack else QuantizedTensor)(codes, scale, spec, None, gs, scale_codes)
