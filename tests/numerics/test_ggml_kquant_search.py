"""Every k-quant's encoding (Q2_K to Q6_K) (llama.cpp's scale/min and symmetric searches) are byte-identical to llama.cpp's C
reference on the bytes it wrote (tests/numerics/data/kquant_reference.safetensors, made by
bench/gguf/check_ggml_reference.py from libggml-base), and decode as gguf-py does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml_kquant_search import _rdiv, encode_q2_k, encode_q3_k, encode_q4_k, encode_q5_k, encode_q6_k, scale_min_search
from lowbit.numerics.ggml import GgmlType
from lowbit.numerics.ggml_kquants import decode

REFERENCE = Path(__file__).parent / "data" / "kquant_reference.safetensors"
ENCODERS = {"q2_k": (encode_q2_k, GgmlType.Q2_K, 84, 0.45), "q3_k": (encode_q3_k, GgmlType.Q3_K, 110, 0.25),
            "q4_k": (encode_q4_k, GgmlType.Q4_K, 144, 0.12), "q5_k": (encode_q5_k, GgmlType.Q5_K, 176, 0.06),
            "q6_k": (encode_q6_k, GgmlType.Q6_K, 210, 0.03)}


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_encode_is_llama_cpp_byte_for_byte(kind):
    encode, _, nb, _ = ENCODERS[kind]
    ref = load_file(str(REFERENCE))
    ours = encode(ref["x"])
    assert ours.shape == ref[kind].shape == (84, nb)
    diff = (ours != ref[kind]).any(dim=1).nonzero().flatten().tolist()
    assert diff == [], f"super-blocks {diff[:5]} differ from llama.cpp's"


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_decodes_as_gguf_py_and_close_to_the_input(kind):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    encode, ktype, _, bound = ENCODERS[kind]
    x = load_file(str(REFERENCE))["x"]
    enc = encode(x)
    back = decode(enc, ktype)
    np.testing.assert_array_equal(back.numpy(), dequantize(enc.numpy(), getattr(gguf.GGMLQuantizationType, ktype.name)))
    rel = ((back - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30))[:48]   # the gaussian rows
    assert float(rel.max()) < bound  # 4 (5)-bit codes, 6-bit scales and mins


def test_the_search_beats_its_first_grid():
    """The weighted squared error of the chosen scale and min is at most that of the plain
    min-max grid it starts from (the search only ever takes a better candidate)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    w = x.abs() + 0.1
    scale, neg_min, q = scale_min_search(x, w)
    err = (w * (scale[:, None] * q.float() - neg_min[:, None] - x) ** 2).sum(1)
    lo, hi = x.amin(1).clamp(max=0), x.amax(1)
    q0 = torch.round((x - lo[:, None]) * (15 / (hi - lo))[:, None]).clamp(0, 15)
    err0 = (w * (((hi - lo) / 15)[:, None] * q0 + lo[:, None] - x) ** 2).sum(1)
    assert bool((err <= err0 * (1 + 1e-5)).all()) and bool((err < err0).any())


def test_q4_k_bad_input():
    with pytest.raises(QuantizationError, match="'w'.*super-block of 256"):
        encode_q4_k(torch.zeros(1, 128), name="w")
    x = torch.zeros(1, 256)
    x[0, 3] = float("inf")
    with pytest.raises(QuantizationError, match="NaN or infinite"):
        encode_q4_k(x)


def test_a_number_over_a_tensor_is_ieee_division():
    """torch computes ``15.0 / t`` as 15 * (1 / t), two roundings: C's 15 / t differs (here the
    4-bit scale of a Q2_K sub-block came out 7 instead of llama.cpp's 8)."""
    t = torch.tensor([1.8333332538604736])
    assert float((_rdiv(15.0, t) * torch.tensor(0.9166666269302368)).round()) == 8.0
    assert float(((15.0 / t) * torch.tensor(0.9166666269302368)).round()) == 7.0  # torch's shortcut
    x = torch.rand(4096, generator=torch.Generator().manual_seed(0)) + 0.5
    np.testing.assert_array_equal(_rdiv(7.0, x).numpy(), np.float32(7.0) / x.numpy())


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_importance_weighted_encode_is_llama_cpp_byte_for_byte(kind):
    """quantize_q*_K with an importance matrix (rows of 512, one weight per input column)."""
    encode, _, nb, _ = ENCODERS[kind]
    ref = load_file(str(REFERENCE))
    rows = ref["x"].reshape(-1, 512)
    ours = encode(rows, importance=ref["importance"])
    assert torch.equal(ours, ref[f"{kind}_weighted"])
    # the weights matter: the plain encoding differs on many super-blocks
    assert int((encode(rows) != ours).reshape(-1, nb).any(dim=1).sum()) > 20


def test_importance_weights_are_checked():
    x = torch.zeros(2, 256)
    with pytest.raises(QuantizationError, match="'w': importance weights must be \\[256\\]"):
        encode_q4_k(x, name="w", importance=torch.ones(128))
    with pytest.raises(QuantizationError, match="finite and non-negative"):
        encode_q4_k(x, name="w", importance=-torch.ones(256))


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_importance_weighted_block_types_are_llama_cpp_byte_for_byte(kind):
    """quantize_q4_0 ... quantize_q5_1 with an importance matrix (rows of 512), through the entry point."""
    from lowbit.numerics.ggml import encode

    ref = load_file(str(REFERENCE))
    rows = ref["x"].reshape(-1, 512)
    assert torch.equal(encode(rows, kind, importance=ref["importance"]), ref[f"{kind}_weighted"])


def test_sqrt32_is_correctly_rounded():
    """sqrtf's result; torch's float32 sqrt is not always (a weighted Q4_0 block differed by it)."""
    from lowbit.numerics.ggml_kquant_search import sqrt32

    x = torch.rand(200_000, generator=torch.Generator().manual_seed(2)) * 10
    x[0] = 2.3364964  # torch.sqrt gives 1.52856016 here, sqrtf 1.5285602
    np.testing.assert_array_equal(sqrt32(x).numpy(), np.sqrt(x.numpy()))


def test_nvfp4_encode_is_ggml_reference_byte_for_byte():
    from lowbit.numerics.ggml import GgmlType, decode, encode

    ref = load_file(str(REFERENCE))
    ours = encode(ref["nvfp4_x"], GgmlType.NVFP4)
    assert torch.equal(ours, ref["nvfp4"])
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    np.testing.assert_array_equal(decode(ours, GgmlType.NVFP4).numpy(),
                                  dequantize(ours.numpy(), gguf.GGMLQuantizationType.NVFP4))


def test_ue4m3_conversion_is_ggml_s():
    """ggml_fp32_to_ue4m3 (half up, not RNE), against gguf-py's port on every UE4M3 midpoint,
    its neighbours, subnormals, 448 and beyond, zero and negatives."""
    pytest.importorskip("gguf")
    from gguf.quants import NVFP4

    from lowbit.numerics.ggml_fp4 import fp32_to_ue4m3

    codes = torch.arange(1, 127, dtype=torch.int32)
    exp, man = codes >> 3, codes & 7
    vals = torch.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7)).float()
    mids = (vals[:-1] + vals[1:]) / 2
    x = torch.cat([vals, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids * 2),
                   torch.tensor([0.0, -1.0, 1e-9, 448.0, 449.0, 1e30, 2.0 ** -10, 3 * 2.0 ** -11])])
    np.testing.assert_array_equal(fp32_to_ue4m3(x).numpy(), NVFP4.fp32_to_ue4m3(x.numpy()))
