"""compressed-tensors' tensor kinds (``lowbit.formats.ct_tensors``): each store reads back exactly
what it writes, for every preset compressed-tensors holds, and a compression format without a
store is refused by name."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import FormatError
from lowbit.formats.ct_args import CTFormat, ct_format_of
from lowbit.formats.ct_tensors import codes_store, scale_store
from lowbit.formats.lowbit_layout import scale_shape
from lowbit.quant import global_scale_from_amax, quantize
from lowbit.schemes import PRESETS


def _held():
    out = []
    for name, scheme in PRESETS.items():
        try:
            out.append((name, ct_format_of(scheme)))
        except FormatError:
            pass
    return out


HELD = _held()


def test_every_written_compression_format_has_a_store():
    assert {f for _, f in HELD} >= {CTFormat.INT_QUANTIZED, CTFormat.FLOAT_QUANTIZED, CTFormat.PACK_QUANTIZED,
                                    CTFormat.NVFP4_PACK_QUANTIZED, CTFormat.MXFP4_PACK_QUANTIZED}
    for _, f in HELD:
        codes_store(f)  # raises for a format without one


@pytest.mark.parametrize("ct_format", [CTFormat.NAIVE_QUANTIZED, CTFormat.NVFP4_E5M3_PACK_QUANTIZED])
def test_a_format_without_a_store_is_refused_by_name(ct_format):
    with pytest.raises(FormatError, match=ct_format.value):
        codes_store(ct_format)


@pytest.mark.parametrize("name,ct_format", HELD, ids=[n for n, _ in HELD])
def test_each_store_reads_back_what_it_writes(name, ct_format):
    spec = PRESETS[name].weights
    out_f, in_f = 64, 256
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(1))
    qt = quantize(w, spec, global_scale=global_scale_from_amax(w.abs().amax().reshape(1), spec)
                  if spec.global_scale else None)
    codes = codes_store(ct_format)
    written = codes.write("p", qt)
    assert [(k.removeprefix("p."), tuple(v.shape), v.dtype) for k, v in written.items()] == \
        [(k, s.shape, s.dtype) for k, s in codes.specs(spec, out_f, in_f).items()]
    assert torch.equal(codes.read("p", written, spec, "layer 'p'"), qt.codes)

    scales = scale_store(spec)
    stored = scales.write(qt, torch.float32)
    declared = scales.spec(spec, out_f, in_f, torch.float32)
    assert (tuple(stored.shape), stored.dtype) == (declared.shape, declared.dtype)
    sshape = scale_shape(spec, out_f, in_f)
    back = scales.read({"p.weight_scale": stored}, "p.weight_scale", stored, spec, sshape, out_f, "layer 'p'")
    assert torch.equal(back, qt.scale.to(torch.float32))

    if qt.zero_point is not None:
        zp = codes.write_zero_point(qt.zero_point, spec)
        assert torch.equal(codes.read_zero_point("p", {"p.weight_zero_point": zp}, spec, sshape, "layer 'p'"),
                           qt.zero_point.to(torch.int8))


def test_a_malformed_packed_weight_is_named():
    store = codes_store(CTFormat.MXFP6_PACK_QUANTIZED)
    bad = {"p.weight_packed": torch.zeros(4, 5, dtype=torch.uint8)}
    with pytest.raises(FormatError, match=r"'p.weight_packed' must be \[out, 3 \* in / 4\], has shape \(4, 5\)"):
        store.read("p", bad, PRESETS["mxfp6-e2m3"].weights, "layer 'p'")
