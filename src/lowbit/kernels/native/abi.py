"""The C ABI of the native library: the ctypes mirrors of the parameter blocks declared in
lowbit_native.h, the exported functions' signatures, and the check made once at load.

The kernels with many parameters (``lb_encode``, ``lb_quantize``, ``lb_gptq_sub``,
``lb_grid_gptq``) take one
parameter block by pointer; each ``ctypes.Structure`` below lists the fields of its C struct in the
same order with the same types. The ABI version is stated once, ``constants.ABI_VERSION``, and
reaches C through the generated header; ``open_checked`` refuses a library whose ``lb_version()`` is
another or whose parameter blocks (``lb_sizeof``) have other sizes than these mirrors.
"""

from __future__ import annotations

import ctypes

from lowbit.kernels.native.constants import ABI_VERSION

P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
F32, U32 = ctypes.c_float, ctypes.c_uint32


class Band(ctypes.Structure):
    """lb_band: source values [rows, cols] (dtype: float32 0, bfloat16 1, float16 2) in groups of g."""

    _fields_ = [("x", P), ("rows", I64), ("cols", I64), ("g", I64), ("dtype", I32)]


class EncodingArgs(ctypes.Structure):
    """lb_encoding: a key table (and its steps) or INT bounds, and whether negatives are refused."""

    _fields_ = [("table", P), ("steps", P), ("qmin", I32), ("qmax", I32), ("bits", I32), ("check_negative", I32)]


class EncodeArgs(ctypes.Structure):
    """lb_encode_args."""

    _fields_ = [("band", Band), ("eff", P), ("enc", EncodingArgs), ("pack", I32), ("out", P)]


class QuantizeArgs(ctypes.Structure):
    """lb_quantize_args."""

    _fields_ = [("band", Band), ("gs", P), ("scale_table", P), ("scale_values", P), ("divisor", F32),
                ("rule", I32), ("e8m0_emax", I32), ("e8m0_max", I32), ("enc", EncodingArgs), ("pack", I32),
                ("out", P), ("scale", P), ("scale_codes", P), ("eff", P), ("lo", P)]


class GptqArgs(ctypes.Structure):
    """lb_gptq_args."""

    _fields_ = [("W", P), ("E", P), ("dv", P), ("ef", P), ("ds", I64), ("m", I64), ("R", I64), ("nparts", I64),
                ("a", P), ("b", P), ("up", P), ("ld", I64), ("j0", I64), ("kind", I32), ("lo", F32), ("hi", F32),
                ("mask", U32), ("lowest", U32), ("shift", U32)]


class GridArgs(ctypes.Structure):
    """lb_grid_args (GPTQ's column loop on a GGML grid, one block)."""

    _fields_ = [("W", P), ("E", P), ("C", P), ("step", P), ("offset", P), ("div", P), ("zmask", P), ("u", P),
                ("ld0", I64), ("ld1", I64), ("j0", I64), ("n", I64), ("R", I64), ("vec", I64), ("zero", F32),
                ("lo", F32), ("hi", F32), ("fill", F32)]


BLOCKS = (EncodeArgs, QuantizeArgs, GptqArgs, GridArgs)  # lb_sizeof(i) is the size of BLOCKS[i] (LB_*_ARGS)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the exported functions; returns ``lib``."""
    ref = lambda s: ctypes.POINTER(s)  # noqa: E731
    sigs = {
        "lb_version": ([], I32),
        "lb_sizeof": ([I32], I64),
        "lb_group_amax": ([P, I32, I64, I64, I64, P], I32),
        "lb_group_minmax": ([P, I32, I64, I64, I64, P, P], I32),
        "lb_encode": ([ref(EncodeArgs)], I32),
        "lb_quantize": ([ref(QuantizeArgs)], I32),
        "lb_gptq_sub": ([ref(GptqArgs)], I32),
        "lb_direct_search": ([P, P, I64, I64, I32, P, I32, P, P], I32),
        "lb_grid_gptq": ([ref(GridArgs)], I32),
        "lb_encode_mxfp4": ([P, I64, P], I32),
        "lb_encode_nvfp4": ([P, I64, P], I32),
        "lb_pack_nibbles": ([P, I64, P], I32),
        "lb_step_codes": ([P, P, I64, I32, I32, P], None),
        "lb_decode": ([P, I64, P, P], None),
        "lb_rounded_weight": ([P, P, P, P, P, I64, I32, F32, F32, U32, U32, U32, P], None),
        "lb_offset_step": ([P, P, P, P, P, I64, F32, I32, F32, F32], None),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def open_checked(path: object) -> ctypes.CDLL:
    """Load the library at ``path`` and declare its functions, once its ABI is checked: raises
    RuntimeError (naming the path) unless its ``lb_version()`` is ABI_VERSION and its parameter
    blocks (``lb_sizeof``) have the sizes of these mirrors."""
    lib = ctypes.CDLL(str(path))
    lib.lb_version.argtypes, lib.lb_version.restype = [], I32
    if lib.lb_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.lb_version()}, expected {ABI_VERSION}")
    declare(lib)
    sizes = [lib.lb_sizeof(i) for i in range(len(BLOCKS))]
    want = [ctypes.sizeof(b) for b in BLOCKS]
    if sizes != want:
        raise RuntimeError(f"{path}: parameter block sizes {sizes}, expected {want}")
    return lib
