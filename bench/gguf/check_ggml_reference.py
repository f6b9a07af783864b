"""lowbit's GGML encoders against llama.cpp's own C reference quantizers (not gguf-py's port).

Builds nothing: give it the ``libggml-base.so`` of a llama.cpp build (../shared/README.md says
how to build llama.cpp from llama-cpp-python's source distribution; ``--target ggml-base`` is
enough) and it encodes the adversarial rows of tests/numerics/test_ggml.py with both, through
ctypes (``quantize_row_*_ref``), and prints whether every byte agrees; for Q4_K and Q5_K (llama.cpp's
scale/min search, lowbit.numerics.ggml_kquant_search) it also writes the C's bytes for the rows
of ``q4_k_rows`` to tests/numerics/data/kquant_reference.safetensors, which CI compares against
(CI has no llama.cpp build).

    .venv/bin/python bench/gguf/check_ggml_reference.py PATH/libggml-base.so
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from lowbit.numerics import ggml_blocks, ggml_fp4  # noqa: E402
from lowbit.numerics.ggml_kquant_search import encode_q2_k, encode_q3_k, encode_q4_k, encode_q5_k, encode_q6_k  # noqa: E402
from numerics.test_ggml import _adversarial_rows, _fp4_rows  # noqa: E402


def c_encode(lib, fn: str, x: np.ndarray, block_bytes: int, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // block * block_bytes, dtype=np.uint8)
    f = getattr(lib, fn)
    f.restype = None
    f(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.reshape(-1, block_bytes)


REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "numerics" / "data" / "kquant_reference.safetensors"


def q4_k_rows() -> torch.Tensor:
    """Super-blocks that exercise the search: several magnitudes, one-signed blocks (the min
    clamps to 0), zero and flat sub-blocks, zeros inside, values on a grid (rounding ties)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(16, 256, generator=g) * s for s in (1e-3, 1.0, 50.0)]
    rows += [torch.randn(8, 256, generator=g).abs(), -torch.randn(8, 256, generator=g).abs()]
    z = torch.zeros(4, 256)
    z[1, :32], z[2, 100], z[3, 32:64] = 0.5, -3.0, torch.linspace(-1, 1, 32)
    rows.append(z)
    t = torch.randn(8, 256, generator=g)
    t[:, ::7] = 0.0
    rows += [t, torch.round(torch.randn(8, 256, generator=g) * 8) / 8]
    return torch.cat(rows)


def nvfp4_rows() -> torch.Tensor:
    """Rows of 64: the FP4 tie rows, and magnitudes from 1e-12 to 1e3 (UE4M3 subnormal, normal and
    saturated scales)."""
    g = torch.Generator().manual_seed(9)
    return torch.cat([_fp4_rows().reshape(-1, 64),
                      torch.randn(200, 64, generator=g) * torch.logspace(-12, 3, 200).reshape(-1, 1)])


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    x = _adversarial_rows().numpy()
    for kind in ggml_blocks.BLOCK_BYTES:
        c = c_encode(lib, f"quantize_row_{kind.value}_ref", x, ggml_blocks.BLOCK_BYTES[kind], 32)
        ours = ggml_blocks.encode(torch.from_numpy(x), kind).numpy()
        print(f"| {kind.value} | {x.shape[0]} | {'identical' if np.array_equal(c, ours) else 'DIFFERENT'} |")
    x = _fp4_rows().numpy()
    c = c_encode(lib, "quantize_row_mxfp4_ref", x, ggml_fp4.MXFP4_BYTES, 32)
    same = np.array_equal(c, ggml_fp4.encode_mxfp4(torch.from_numpy(x)).numpy())
    print(f"| mxfp4 | {x.shape[0]} | {'identical' if same else 'DIFFERENT'} |")
    x = nvfp4_rows()
    c = c_encode(lib, "quantize_row_nvfp4_ref", x.numpy(), ggml_fp4.NVFP4_BYTES, 64)
    same = np.array_equal(c, ggml_fp4.encode_nvfp4(x).numpy())
    print(f"| nvfp4 | {x.shape[0]} | {'identical' if same else 'DIFFERENT'} |")
    nvfp4_ref = {"nvfp4_x": x.contiguous(), "nvfp4": torch.from_numpy(c).contiguous()}
    x = q4_k_rows()
    ref = {"x": x.contiguous(), **nvfp4_ref}
    for kind, fn, nb, encode in (("q2_k", "quantize_row_q2_K_ref", 84, encode_q2_k),
                                 ("q3_k", "quantize_row_q3_K_ref", 110, encode_q3_k),
                                 ("q4_k", "quantize_row_q4_K_ref", 144, encode_q4_k),
                                 ("q5_k", "quantize_row_q5_K_ref", 176, encode_q5_k),
                                 ("q6_k", "quantize_row_q6_K_ref", 210, encode_q6_k)):
        c = c_encode(lib, fn, x.numpy(), nb, 256)
        same = np.array_equal(c, encode(x).numpy())
        print(f"| {kind} | {x.shape[0]} | {'identical' if same else 'DIFFERENT'} |")
        ref[kind] = torch.from_numpy(c).contiguous()
    # importance-weighted Q4_K (quantize_q4_K with quant_weights), rows of 512, one weight per column
    imp = (torch.rand(512, generator=torch.Generator().manual_seed(7)) ** 3 * 10).contiguous()
    imp[::9] = 0.0
    rows = np.ascontiguousarray(x.reshape(-1, 512).numpy())
    ref["importance"] = imp
    from lowbit.numerics.ggml import GEOMETRY, GgmlType, encode as ggml_encode

    for kind in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1"):
        n, nb = GEOMETRY[GgmlType(kind)]
        out = np.zeros(rows.size // n * nb, dtype=np.uint8)
        f = getattr(lib, "quantize_" + kind.replace("_k", "_K"))
        f.restype = ctypes.c_size_t
        f(rows.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(rows.shape[0]),
          ctypes.c_int64(512), imp.numpy().ctypes.data_as(ctypes.c_void_p))
        c = out.reshape(rows.shape[0], -1)
        same = np.array_equal(c, ggml_encode(torch.from_numpy(rows), kind, importance=imp).numpy())
        print(f"| {kind}, importance-weighted | {rows.size // n} | {'identical' if same else 'DIFFERENT'} |")
        ref[f"{kind}_weighted"] = torch.from_numpy(c).contiguous()
    from safetensors.torch import save_file

    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    save_file(ref, str(REFERENCE), metadata={"source": "llama.cpp quantize_row_q*_K_ref, llama-cpp-python 0.3.36 "
                                                       "(ggml 0.25.3)"})


if __name__ == "__main__":
    main()
