"""lowbit's GGML encoders against llama.cpp's own C reference quantizers (not gguf-py's port).

Builds nothing: give it the ``libggml-base.so`` of a llama.cpp build (../shared/README.md says
how to build llama.cpp from llama-cpp-python's source distribution; ``--target ggml-base`` is
enough) and it encodes the adversarial rows of tests/numerics/test_ggml.py with both, through
ctypes (``quantize_row_*_ref``), and prints whether every byte agrees.

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
from lowbit.numerics.ggml_blocks import GgmlBlockType  # noqa: E402
from numerics.test_ggml import _adversarial_rows, _fp4_rows  # noqa: E402


def c_encode(lib, fn: str, x: np.ndarray, block_bytes: int, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // block * block_bytes, dtype=np.uint8)
    f = getattr(lib, fn)
    f.restype = None
    f(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.reshape(-1, block_bytes)


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    x = _adversarial_rows().numpy()
    for kind in GgmlBlockType:
        c = c_encode(lib, f"quantize_row_{kind.value}_ref", x, ggml_blocks.BLOCK_BYTES[kind], 32)
        ours = ggml_blocks.encode(torch.from_numpy(x), kind).numpy()
        print(f"| {kind.value} | {x.shape[0]} | {'identical' if np.array_equal(c, ours) else 'DIFFERENT'} |")
    x = _fp4_rows().numpy()
    c = c_encode(lib, "quantize_row_mxfp4_ref", x, ggml_fp4.MXFP4_BYTES, 32)
    same = np.array_equal(c, ggml_fp4.encode_mxfp4(torch.from_numpy(x)).numpy())
    print(f"| mxfp4 | {x.shape[0]} | {'identical' if same else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
