"""Q4_K's encoding (llama.cpp's scale/min search) is byte-identical to llama.cpp's C reference on
the bytes it wrote (tests/numerics/data/q4_k_reference.safetensors, made by
bench/gguf/check_ggml_reference.py from libggml-base), and decodes as gguf-py does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml_kquant_search import encode_q4_k, scale_min_search
from lowbit.numerics.ggml_kquants import KQuantType, decode

REFERENCE = Path(__file__).parent / "data" / "q4_k_reference.safetensors"


def test_q4_k_encode_is_llama_cpp_byte_for_byte():
    ref = load_file(str(REFERENCE))
    ours = encode_q4_k(ref["x"])
    assert ours.shape == ref["q4_k"].shape == (84, 144)
    diff = (ours != ref["q4_k"]).any(dim=1).nonzero().flatten().tolist()
    assert diff == [], f"super-blocks {diff[:5]} differ from llama.cpp's"


def test_q4_k_decodes_as_gguf_py_and_close_to_the_input():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    x = load_file(str(REFERENCE))["x"]
    enc = encode_q4_k(x)
    back = decode(enc, KQuantType.Q4_K)
    np.testing.assert_array_equal(back.numpy(), dequantize(enc.numpy(), gguf.GGMLQuantizationType.Q4_K))
    rel = ((back - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30))[:48]   # the gaussian rows
    assert float(rel.max()) < 0.12  # 4-bit codes, 6-bit scales and mins: about 8% of the norm


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
