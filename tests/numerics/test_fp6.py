"""FP6 E2M3 and E3M2 (OCP MX): every code, every float16 / bfloat16 input and a million random
float32, against two independent references: a brute-force nearest-code search built from the
bit fields (no lowbit code) and ml_dtypes' float6_e2m3fn / float6_e3m2fn casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.numerics import E2M3, E3M2, FormatName, get_format
from test_numerics_formats import KINDS, brute_force_codes, inputs

FP6 = [(E2M3, ml_dtypes.float6_e2m3fn, 7.5, 0.125), (E3M2, ml_dtypes.float6_e3m2fn, 28.0, 0.0625)]
IDS = ["e2m3", "e3m2"]


@pytest.mark.parametrize("fmt,ml,max_finite,min_sub", FP6, ids=IDS)
def test_every_code_decodes_as_the_bit_fields_say(fmt, ml, max_finite, min_sub):
    codes = torch.arange(64, dtype=torch.uint8)
    vals = fmt.decode(codes)
    ref = torch.from_numpy(np.arange(64, dtype=np.uint8).view(ml).astype(np.float32))
    assert torch.equal(vals, ref) and torch.equal(torch.signbit(vals), torch.signbit(ref))
    assert float(vals.max()) == max_finite and float(vals[1]) == min_sub and fmt.bits == 6
    assert get_format(FormatName(fmt.name)) is fmt
    assert fmt.decode(torch.tensor([64, 255], dtype=torch.uint8)).isnan().all()  # outside 6 bits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,ml,max_finite,min_sub", FP6, ids=IDS)
def test_encode_is_nearest_even_and_saturating(fmt, ml, max_finite, min_sub, kind):
    x = inputs(kind)
    x = x[~torch.isnan(x)]
    codes = fmt.encode(x)
    mag = codes & 0x1F
    sign = (codes >> 5) & 1
    # brute force on magnitudes (ties to the even code), saturating at the largest code
    want = brute_force_codes(fmt, torch.clamp(x.abs(), max=3.4e38)).to(torch.uint8)
    assert torch.equal(mag, want)
    assert torch.equal(sign.bool(), torch.signbit(x))
    # ml_dtypes: the same values (it saturates too: no Inf or NaN in FP6)
    ref = torch.from_numpy(x.numpy().astype(ml).astype(np.float32))
    assert torch.equal(fmt.decode(codes), ref)


@pytest.mark.parametrize("fmt", [E2M3, E3M2], ids=IDS)
def test_ties_binade_edges_subnormals_and_saturation(fmt):
    step_sub = 2.0 ** (1 - fmt.bias - fmt.man_bits)
    top = float(fmt.decode(torch.tensor([0x1F], dtype=torch.uint8)))
    below = float(fmt.decode(torch.tensor([0x1E], dtype=torch.uint8)))
    x = torch.tensor([step_sub / 2, 3 * step_sub / 2, (below + top) / 2, top, top * 1.01, float("inf"),
                      -float("inf"), 2.0 ** -40, 1.0 + 2.0 ** -(fmt.man_bits + 1)])
    q = fmt.qdq(x).tolist()
    assert q[0] == 0.0                      # tie between 0 and the smallest subnormal: even (0)
    assert q[1] == 2 * step_sub              # tie between codes 1 and 2: even (2)
    assert q[2] == below                     # tie between codes 30 and 31: the even code, 30
    assert q[3] == top and q[4] == top and q[5] == top and q[6] == -top
    assert q[7] == 0.0
    assert q[8] == 1.0                       # the tie above 1.0 in its binade: the even code (1.0)


def test_top_tie_goes_to_the_even_code():
    for fmt in (E2M3, E3M2):
        below, top = fmt.decode(torch.tensor([0x1E, 0x1F], dtype=torch.uint8)).tolist()
        assert fmt.qdq(torch.tensor([(below + top) / 2])).item() == below  # 0x1E is even


def test_fp6_refuses_nan():
    for fmt in (E2M3, E3M2):
        with pytest.raises(ValueError, match="NaN"):
            fmt.encode(torch.tensor([1.0, float("nan")]))
