"""Each checkpoint format declares what it writes: ``Layout.tensor_specs`` names, shapes, dtypes
and order equal what ``linear_tensors`` writes, for every preset scheme the format holds, on
shapes with one, several and ragged groups, with and without bias and static input scales."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import FormatError, LowbitError
from lowbit.formats import LAYOUTS, get_layout
from lowbit.quant import global_scale_from_amax, quantize
from lowbit.schemes import PRESETS

SHAPES = [(64, 128), (48, 256), (32, 160), (96, 512)]


def _written(layout, scheme, out_f, in_f, dtype, extras):
    spec = scheme.weights
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0))
    gs = global_scale_from_amax(w.abs().amax().reshape(1), spec) if spec.global_scale else None
    qt = quantize(w, spec, global_scale=gs)
    kwargs = {}
    if extras:
        kwargs = {"bias": torch.randn(out_f), "input_scale": torch.tensor([0.5]),
                  "input_global_scale": torch.tensor([448.0 * 6.0])}
    return layout.linear_tensors("layer", qt, scheme, dtype=dtype, **kwargs)


@pytest.mark.parametrize("fmt", [layout.format for layout in LAYOUTS])
@pytest.mark.parametrize("name", list(PRESETS))
def test_declared_tensors_are_the_written_ones(fmt, name):
    layout, scheme = get_layout(fmt), PRESETS[name]
    try:
        layout.check_scheme(scheme)
    except FormatError:
        pytest.skip(f"{fmt.value} cannot hold {name}")
    checked = 0
    for out_f, in_f in SHAPES:
        for extras in (False, True):
            for dtype in (torch.bfloat16, torch.float32):
                try:
                    got = _written(layout, scheme, out_f, in_f, dtype, extras)
                except LowbitError:  # a shape the scheme or the format refuses: nothing to declare
                    continue
                declared = layout.tensor_specs(scheme, out_f, in_f, dtype=dtype, bias=extras, input_scale=extras,
                                               input_global_scale=extras)
                written = [(k.removeprefix("layer."), tuple(v.shape), v.dtype) for k, v in got.items()]
                assert [(k, s.shape, s.dtype) for k, s in declared.items()] == written, (out_f, in_f, extras)
                checked += 1
    assert checked >= 4
