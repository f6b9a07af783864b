"""Native (C) kernels on CPU tensors: per-group extremes and fused divide + encode (+ nibble pack);
GPTQ's sub-block column loop (``gptq_sub_fn``, raw pointers: lowbit.algorithms.gptq_solve); GGML's
direct search and GPTQ's block loop on a GGML grid (``direct_search``, ``grid_block_fn``:
ggml_native.c), GGML's FP4 encoders (``encode_fp4``: ggml_fp4_native.c), through
lowbit.kernels.ggml. The C
functions with many parameters take a parameter block (lowbit.kernels.native.abi), filled here.

Each wrapper returns None when the library is not to be used (the kernel setting,
lowbit.kernels.select, does not allow the native implementation) or cannot be built; callers then
take the next implementation, which gives the same bits.
Inputs: 2-D contiguous CPU tensors [rows, cols] of float32, bfloat16 or float16; groups of ``g``
consecutive elements of a row, the last one possibly shorter (it acts zero-padded).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from lowbit.kernels.native.abi import Band, EncodeArgs, EncodingArgs, GptqArgs, GridArgs, QuantizeArgs
from lowbit.kernels.native.constants import STEPS
from lowbit.kernels.select import native_library as library

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` (CPU, a supported float dtype) and the library loads."""
    return x.device.type == "cpu" and x.dtype in DTYPES and library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    assert x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu", "native kernels take 2-D contiguous CPU"
    return x.shape[0], x.shape[1]


def _band(x: torch.Tensor, rows: int, cols: int, g: int) -> Band:
    return Band(_ptr(x), rows, cols, g, DTYPES[x.dtype])


def group_amax(x: torch.Tensor, g: int) -> tuple[torch.Tensor, bool] | None:
    """(float32 [rows, G] absolute max per group, whether x holds NaN/Inf)."""
    lib = library()
    if lib is None:
        return None
    rows, cols = _rows_cols(x)
    out = torch.empty(rows, -(-cols // g), dtype=torch.float32)
    bad = lib.lb_group_amax(_ptr(x), DTYPES[x.dtype], rows, cols, g, _ptr(out))
    return out, bool(bad)


def group_minmax(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """(float32 [rows, G] signed min, signed max per group (a ragged group includes 0), NaN/Inf)."""
    lib = library()
    if lib is None:
        return None
    rows, cols = _rows_cols(x)
    lo = torch.empty(rows, -(-cols // g), dtype=torch.float32)
    hi = torch.empty_like(lo)
    bad = lib.lb_group_minmax(_ptr(x), DTYPES[x.dtype], rows, cols, g, _ptr(lo), _ptr(hi))
    return lo, hi, bool(bad)


@dataclass(frozen=True)
class Encoding:
    """How the kernels encode an element format: its key table (and the table's steps, for
    E2M1), or INT bounds; ``negative_refused``: an unsigned format (negative input goes to the
    reference's error)."""

    table: torch.Tensor | None
    steps: torch.Tensor | None
    qmin: int
    qmax: int
    bits: int
    negative_refused: bool

    def block(self) -> EncodingArgs:
        """The lb_encoding parameter block (pointers into ``table`` and ``steps``, kept alive here)."""
        return EncodingArgs(_ptr(self.table), _ptr(self.steps), self.qmin, self.qmax, self.bits,
                            int(self.negative_refused))


_NO_STEP = 0x8000  # a step no key reaches (magnitudes are 15 bits): pads formats with fewer codes


def has_table(fmt: object) -> bool:
    """Whether the kernels encode ``fmt`` through its key table (the minifloat tables, and E8M0's)."""
    return bool(getattr(fmt, "has_key_table", False))


@lru_cache(maxsize=None)
def steps(fmt: object) -> torch.Tensor | None:
    """uint16 [STEPS + 1] for the step encoder: ``fmt.key_steps`` (the first magnitude key of each
    magnitude code 1.., then the sign's code bits) padded to STEPS, or None (no steps, or more
    than STEPS of them: the kernels then look keys up). Built once per format."""
    ks = getattr(fmt, "key_steps", None)
    if ks is None or len(ks[0]) > STEPS:
        return None
    bounds, sign = ks
    return torch.tensor([*bounds, *[_NO_STEP] * (STEPS - len(bounds)), sign], dtype=torch.int32).to(torch.uint16)


@lru_cache(maxsize=None)
def encoding(fmt: object) -> Encoding | None:
    """The kernels' encoding of ``fmt`` (table formats, E8M0, INTn), or None."""
    from lowbit.numerics.integer import IntFormat

    if has_table(fmt):
        return Encoding(fmt.key_table, steps(fmt), 0, 0, 8, not getattr(fmt, "signed", False))  # type: ignore[attr-defined]
    if isinstance(fmt, IntFormat):
        return Encoding(None, None, fmt.qmin, fmt.qmax, fmt.bits, False)
    return None


def encode_format(fmt: object, x: torch.Tensor) -> torch.Tensor | None:
    """``fmt.encode(x)`` in one C pass, or None when it does not apply (the setting does not allow
    the native implementation, not CPU, another format, or an input the reference refuses or
    encodes as NaN: the next implementation then gives its error or code)."""
    if not x.numel() or encoding(fmt) is None or not usable(x):
        return None
    codes = encode(x.reshape(1, -1).contiguous(), 0, None, fmt)
    return None if codes is None else codes.reshape(x.shape)


def rounding_args(fmt) -> tuple[int, float, float, int, int, int]:
    """The rounding arguments of the native GPTQ sub-block (``lb_gptq_sub``): (kind, lo, hi, mask,
    lowest, shift); INT: (0, qmin, qmax, 0, 0, 0), signed minifloats: (1, max finite, 0, and
    ``MiniFloat.round_magic``), the constants of lowbit.kernels.torch_ops.round_nearest_."""
    from lowbit.numerics.integer import IntFormat

    if isinstance(fmt, IntFormat):
        return 0, float(fmt.qmin), float(fmt.qmax), 0, 0, 0
    return (1, float(fmt.max_finite), 0.0, *fmt.round_magic)


def _codes_call(x: torch.Tensor, fmt: object, pack: bool, out: torch.Tensor | None):
    """(library, encoding of fmt, rows, cols, codes output) for a call that encodes x in fmt, or
    None when the library or the format's encoding is unavailable."""
    lib = library()
    enc = encoding(fmt) if lib is not None else None
    if enc is None:
        return None
    rows, cols = _rows_cols(x)
    if pack and (cols % 2 or fmt.bits != 4):
        raise ValueError(f"nibble packing needs 4-bit codes and an even last dimension, got {fmt.name}, {cols}")
    shape = (rows, cols // 2 if pack else cols)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    assert out.shape == shape and out.dtype == torch.uint8 and out.is_contiguous()
    return lib, enc, rows, cols, out


def encode(x: torch.Tensor, g: int, eff: torch.Tensor | None, fmt: object, *, pack: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """uint8 codes of ``fmt`` for x / eff (eff: float32 [rows, G], zero means code 0; None: x
    itself), nibble-packed into [rows, cols / 2] when ``pack``; written into ``out`` if given.
    None when the library is unavailable or a value needs the reference encoder (NaN, negative
    input of an unsigned format): the caller's torch path then raises the reference's error."""
    call = _codes_call(x, fmt, pack, out)
    if call is None:
        return None
    lib, enc, rows, cols, out = call
    if eff is not None:
        assert eff.dtype == torch.float32 and eff.is_contiguous() and eff.shape == (rows, -(-cols // g))
    status = lib.lb_encode(ctypes.byref(EncodeArgs(_band(x, rows, cols, g), _ptr(eff), enc.block(), int(pack),
                                                   _ptr(out))))
    return out if status == 0 else None


@dataclass(frozen=True)
class ScaleRule:
    """A scale rule as lb_quantize applies it (lowbit_native.c, "whole band"): ``kind`` one of
    RULE_*, the divisor, the scale format's key table and code values (RULE_TABLE, RULE_E8M0),
    and for RULE_E8M0 the element format's largest exponent and the largest code."""

    kind: int
    divisor: float = 1.0
    scale_table: torch.Tensor | None = None
    scale_values: torch.Tensor | None = None
    e8m0_emax: int = 0
    e8m0_max: int = 0


RULE_DIVIDE, RULE_FULL_RANGE, RULE_TABLE, RULE_E8M0 = range(4)


def quantize(x: torch.Tensor, g: int, rule: ScaleRule, global_scale: torch.Tensor | None, fmt: object, *,
             pack: bool = False, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | int | None:
    """A band in one call: per-group extremes, the scale rule, the codes. Returns (codes, float32
    scales [rows, G], their uint8 codes or None), or 1 when x holds NaN/Inf or a value needs the
    reference encoder (the caller decides), or None when the library is unavailable."""
    call = _codes_call(x, fmt, pack, out)
    if call is None:
        return None
    lib, enc, rows, cols, out = call
    G = -(-cols // g)
    scale = torch.empty(rows, G, dtype=torch.float32)
    eff = torch.empty(rows, G, dtype=torch.float32)
    lo = torch.empty(rows, G, dtype=torch.float32) if rule.kind == RULE_FULL_RANGE else None
    codes = torch.empty(rows, G, dtype=torch.uint8) if rule.kind in (RULE_TABLE, RULE_E8M0) else None
    gs = None if global_scale is None else global_scale.reshape(1).to(torch.float32).contiguous()
    args = QuantizeArgs(_band(x, rows, cols, g), _ptr(gs), _ptr(rule.scale_table), _ptr(rule.scale_values),
                        rule.divisor, rule.kind, rule.e8m0_emax, rule.e8m0_max, enc.block(), int(pack), _ptr(out),
                        _ptr(scale), _ptr(codes), _ptr(eff), _ptr(lo))
    status = lib.lb_quantize(ctypes.byref(args))
    if status < 0:
        raise ValueError(f"lb_quantize refused its arguments ({rows}x{cols}, group {g}, rule {rule.kind})")
    return (out, scale, codes) if status == 0 else 1


def decode(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """float32 ``values[codes]`` (uint8 codes on the CPU, values: float32 [256], a format's
    ``code_values``), or None when the library is unavailable."""
    lib = library()
    if lib is None or codes.device.type != "cpu":
        return None
    assert codes.dtype == torch.uint8 and values.dtype == torch.float32 and values.numel() == 256
    codes = codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    lib.lb_decode(_ptr(codes), codes.numel(), _ptr(values.contiguous()), _ptr(out))
    return out


def pack_nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(packed uint8 [..., n / 2], the largest code) of contiguous uint8 codes [..., n], n even."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] // 2, dtype=torch.uint8)
    m = lib.lb_pack_nibbles(_ptr(codes), codes.numel(), _ptr(out))
    return out, int(m)


def gptq_sub_fn():
    """GPTQ's column loop inside one sub-block in C (``lb_gptq_sub``, lowbit.algorithms.gptq_solve), or
    None when the library is unavailable: a function of the fields of lb_gptq_args in their order
    (W, E, dv, ef, ds, m, R, nparts, a, b, up, ld, j0, then ``rounding_args``), which fills the
    parameter block and calls the kernel."""
    lib = library()
    if lib is None:
        return None
    fn = lib.lb_gptq_sub

    def sub(*fields) -> int:
        return fn(ctypes.byref(GptqArgs(*fields)))

    return sub


def offsets_fit(V: torch.Tensor, floats: tuple[torch.Tensor, ...], zero: torch.Tensor) -> bool:
    """Whether the offset kernels take these: contiguous CPU tensors of V's shape, ``V`` and
    ``floats`` float32, ``zero`` bool."""
    ts = (V, *floats, zero)
    return (all(t.device.type == "cpu" and t.is_contiguous() and t.shape == V.shape for t in ts)
            and all(t.dtype == torch.float32 for t in (V, *floats)) and zero.dtype == torch.bool)


def rounded_weight(V: torch.Tensor, v: torch.Tensor, step: torch.Tensor, e: torch.Tensor, zero: torch.Tensor,
                   fmt: object) -> torch.Tensor | None:
    """Block reconstruction's rounded weight in one C pass (``lb_rounded_weight``): float32
    ``where(zero, 0, ((r - x) + x) * e)``, x = V * step + v, r the nearest grid value of x in
    ``fmt`` (INT or a signed minifloat); None when the library is unavailable or the tensors are
    not contiguous float32 CPU tensors of one shape (``zero``: bool)."""
    lib = library()
    if lib is None or not offsets_fit(V, (v, step, e), zero):
        return None
    kind, lo, hi, mask, lowest, shift = rounding_args(fmt)
    out = torch.empty_like(V)
    lib.lb_rounded_weight(_ptr(V), _ptr(v), _ptr(step), _ptr(e), _ptr(zero), V.numel(), kind, lo, hi, mask, lowest,
                          shift, _ptr(out))
    return out


def offset_step(V: torch.Tensor, g: torch.Tensor, e: torch.Tensor, step: torch.Tensor, zero: torch.Tensor,
                lr: float, exponent: int | None = None) -> bool:
    """One signed step of the offsets in place, in one C pass (``lb_offset_step``):
    ``V = clamp(V - sign(where(zero, 0, g) * e * step) * lr, -0.5, 0.5)`` in float32, g first
    rounded to a multiple of 2^-exponent when given (0 <= exponent <= 126: the one-atom gradient
    sum's rounding, lowbit.algorithms.reconstruct_steps); False (V untouched) when the library is
    unavailable or the tensors do not fit (as ``rounded_weight``)."""
    lib = library()
    if lib is None or not offsets_fit(V, (g, e, step), zero):
        return False
    if exponent is not None and not 0 <= exponent <= 126:
        raise ValueError(f"offset_step: exponent {exponent} outside 0..126")
    up, down = (1.0, 1.0) if exponent is None else (2.0 ** exponent, 2.0 ** -exponent)
    lib.lb_offset_step(_ptr(V), _ptr(g), _ptr(e), _ptr(step), _ptr(zero), V.numel(), float(lr),
                       int(exponent is not None), up, down)
    return True


# ---------------------------------------------------------------- GGML (ggml_native.c)

DIRECT_MAX_N = 64  # the C kernel's largest block (ggml_native.c)


def _f32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def direct_search(x: torch.Tensor, nmax: int, w: torch.Tensor, numerators: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``lb_direct_search``: (float32 scale [S], uint8 codes [S, n]) of blocks x, w [S, n] (contiguous
    float32 CPU, n <= 64) over the candidates -(nmax + t_i) given as float32 ``numerators`` (in
    the order tried); None when the library is unavailable, the tensors do not fit or x holds
    NaN or Inf (the torch code then decides)."""
    lib = library()
    if lib is None or x.dim() != 2 or w.shape != x.shape or not _f32_cpu(x, w, numerators):
        return None
    S, n = x.shape
    if not 1 <= n <= DIRECT_MAX_N:
        return None
    scale = torch.empty(S, dtype=torch.float32)
    codes = torch.empty(S, n, dtype=torch.uint8)
    status = lib.lb_direct_search(x.data_ptr(), w.data_ptr(), S, n, int(nmax), numerators.data_ptr(),
                                  numerators.numel(), scale.data_ptr(), codes.data_ptr())
    return (scale, codes) if status == 0 else None


FP4_ENCODERS = {"mxfp4": "lb_encode_mxfp4", "nvfp4": "lb_encode_nvfp4"}  # ggml_fp4_native.c


def encode_fp4(x: torch.Tensor, kind: str) -> torch.Tensor | None:
    """GGML ``kind`` ("mxfp4" or "nvfp4") bytes of ``x`` [..., K], uint8 [..., K / n * B]: those of
    lowbit.numerics.ggml_fp4's encoders (ggml_fp4_native.c); None when the library is unavailable,
    x is not a nonempty contiguous float32 CPU tensor whose last dimension the block divides, or
    x holds NaN or Inf (the reference then raises its error)."""
    from lowbit.numerics.ggml import GEOMETRY, GgmlType

    n, nb = GEOMETRY[GgmlType(kind)]
    lib = library()
    if lib is None or not x.numel() or x.dim() < 1 or x.shape[-1] % n or not _f32_cpu(x):
        return None
    out = torch.empty(*x.shape[:-1], x.shape[-1] // n * nb, dtype=torch.uint8)
    status = getattr(lib, FP4_ENCODERS[kind])(x.data_ptr(), x.numel() // n, out.data_ptr())
    return out if status == 0 else None


@lru_cache(maxsize=None)
def addr_vector_width() -> int | None:
    """The float vector width of torch's CPU ``addr_`` here, when it computes ``w + u e`` as one fused
    multiply-add in its vector loop and with two roundings (product, then sum) in the scalar tail
    of each contiguous run, the last ``len % width`` elements (what lb_grid_gptq reproduces); None
    when its CPU capability has another width or a seeded check of those rules fails."""
    width = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    if width is None:
        return None
    g = torch.Generator().manual_seed(0)
    for K, R in ((3, 2 * width + 5), (2, width - 1), (4, width), (2 * width + 3, 1)):
        W, u, e = (torch.randn(*s, generator=g) for s in ((K, R), (K,), (R,)))
        got = W.clone().addr_(u, e)
        exact = (W.double() + u.double()[:, None] * e.double()[None]).to(torch.float32)  # one rounding here
        two = W + u[:, None] * e[None]
        n = K * R if R == 1 else R
        idx = torch.arange(n)
        fused = (idx < n - n % width).reshape((K, 1) if R == 1 else (1, R)).expand(K, R)
        if not torch.equal(got, torch.where(fused, exact, two)):
            return None
    return width


def grid_block_fn():
    """GPTQ's column loop inside one block on a GGML grid in C (``lb_grid_gptq``,
    lowbit.algorithms.gptq_grid), or None when the library is unavailable or torch's ``addr_`` here
    follows other rules (``addr_vector_width``): a function
    ``f(W1, E1, C1, step, offset, div, zmask, u, j0, zero, lo, hi, fill)`` of the block's rows
    [n, R] (contiguous float32 CPU views; zmask bool) and -Ub ``u`` [in, in] that fills E1, C1
    and W1 as the torch loop does (``u`` float32 of any strides: they decide, for one-row weights,
    which updates torch fuses)."""
    width = addr_vector_width()
    lib = library()
    if width is None or lib is None:
        return None
    fn = lib.lb_grid_gptq

    def block(W1, E1, C1, step, offset, div, zmask, u, j0, zero, lo, hi, fill) -> None:
        n, R = W1.shape
        assert u.dtype == torch.float32 and _f32_cpu(W1, E1, C1, step, offset, div) and zmask.is_contiguous()
        args = GridArgs(W1.data_ptr(), E1.data_ptr(), C1.data_ptr(), step.data_ptr(), offset.data_ptr(),
                        div.data_ptr(), zmask.data_ptr(), u.data_ptr(), u.stride(0), u.stride(1), j0, n, R, width,
                        float(zero), float(lo), float(hi), float(fill))
        if fn(ctypes.byref(args)) != 0:
            raise MemoryError("lb_grid_gptq: no scratch memory")

    return block
