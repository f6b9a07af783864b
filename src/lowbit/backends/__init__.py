"""Backends that run QuantLinear, described as data (``BACKENDS``) and chosen per layer.

    lowbit.use_backend(model, "reference" | "cpu-int8" | ... | "auto")

``BACKENDS`` is a constant tuple of specs; ``REGISTRY`` answers questions about it (by name, best
for a layer) and sets backends on a model. Nothing is chosen at import or inside a forward: a
layer runs the backend ``use_backend`` set (``lowbit.quantize`` and ``lowbit.load`` set "auto").
"""

from __future__ import annotations

from lowbit.backends import cpu_int8 as _cpu_int8
from lowbit.backends import gpu_w8a8 as _gpu_w8a8
from lowbit.backends import triton_mx as _triton_mx
from lowbit.backends import vllm_cpu as _vllm_cpu
from lowbit.backends import weight_cache as _weight_cache
from lowbit.backends.reference import ReferenceBackend
from lowbit.backends.registry import Backend, BackendRegistry, BackendSpec
from lowbit.errors import LowbitError
from lowbit.quant.serving import ServingNumerics

BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="reference", factory=ReferenceBackend, devices=frozenset({"cpu", "cuda"}),
        supports_scheme=lambda s: True, priority=0, matches_reference=True,
        description="exact emulation in float32 (QDQ input, dequantize weight, F.linear)",
    ),
    BackendSpec(
        name="cpu-int8", factory=_cpu_int8.CpuInt8Backend, devices=frozenset({"cpu"}),
        supports_scheme=_cpu_int8.supports_scheme, priority=10,
        description="w8a8-int8 (static/dynamic): int8 values in float32 GEMM, K chunks <= 1024, exact int32 "
                    "accumulators",
    ),
    BackendSpec(
        name="weight-cache", factory=_weight_cache.WeightCacheBackend, devices=frozenset({"cpu"}),
        supports_scheme=_weight_cache.supports_scheme, priority=5, matches_reference=True,
        description="weight dequantized once and kept in float32 (weight-only and FP schemes; 'reference' saves "
                    "that memory)",
    ),
    BackendSpec(
        name="triton", factory=_triton_mx.TritonBackend, devices=frozenset({"cuda"}),
        supports_scheme=_triton_mx.supports, priority=20, available=_triton_mx.available,
        description="GPU: Triton QDQ of microscaled inputs + packed-weight dequantization (bit-exact), cuBLAS matmul",
    ),
    BackendSpec(
        name="cuda-int8", factory=_gpu_w8a8.Int8MMBackend, devices=frozenset({"cuda"}),
        supports_scheme=_gpu_w8a8.supports_int8, supports_shape=lambda i, o: i % 8 == 0 and o % 8 == 0,
        priority=20, available=_gpu_w8a8.int8_available,
        description="GPU w8a8-int8: Triton input quantization (bit-exact) + torch._int_mm (exact int32)",
    ),
    BackendSpec(
        name="cuda-fp8", factory=_gpu_w8a8.FP8MMBackend, devices=frozenset({"cuda"}),
        supports_scheme=_gpu_w8a8.supports_fp8, supports_shape=lambda i, o: i % 16 == 0 and o % 16 == 0,
        priority=20, available=_gpu_w8a8.fp8_available,
        description="GPU w8a8-fp8 (sm_89+): Triton input quantization (bit-exact) + torch._scaled_mm",
    ),
    BackendSpec(
        name="vllm-cpu-int8", factory=_vllm_cpu.VllmCpuInt8Backend, devices=frozenset({"cpu"}),
        supports_scheme=_vllm_cpu.supports_scheme, priority=0, auto=False,
        description="w8a8-int8 as vLLM's CPU build serves it (x * 1/s codes, oneDNN scale order, bf16 out); "
                    "set by numerics=ServingNumerics.VLLM_CPU (AVX2 hosts)",
    ),
    BackendSpec(
        name="vllm-cpu-avx512-int8", factory=_vllm_cpu.VllmCpuInt8Avx512Backend, devices=frozenset({"cpu"}),
        supports_scheme=_vllm_cpu.supports_scheme, priority=0, auto=False,
        description="w8a8-int8 as vLLM's CPU build serves it on an AVX-512 + VNNI host (exact int8 sums, bf16 "
                    "rounded to nearest); set by numerics=ServingNumerics.VLLM_CPU_AVX512",
    ),
    BackendSpec(
        name="vllm-cpu-fp8", factory=_vllm_cpu.VllmCpuFp8Backend, devices=frozenset({"cpu"}),
        supports_scheme=_vllm_cpu.supports_fp8_dynamic, priority=0, auto=False,
        description="w8a8-fp8-dynamic as vLLM's CPU build serves it (x * 1/s values, float32 GEMM, bf16 out); "
                    "set by numerics=ServingNumerics.VLLM_CPU and VLLM_CPU_AVX512",
    ),
)

#: the backend that reproduces each engine's numerics, for the schemes it covers
SERVING_BACKENDS = {ServingNumerics.VLLM_CPU: ("vllm-cpu-int8", "vllm-cpu-fp8"),
                    ServingNumerics.VLLM_CPU_AVX512: ("vllm-cpu-avx512-int8", "vllm-cpu-fp8")}

REGISTRY = BackendRegistry(BACKENDS)


def select_backend(module) -> Backend:
    """A new instance of the best automatic backend for ``module``."""
    return REGISTRY.select(module)


def use_backend(model, name: str = "auto") -> dict[str, int]:
    """Set ``name`` (or the best automatic choice per layer) on every lowbit layer of ``model``."""
    return REGISTRY.use(model, name)


def use_numerics(model, numerics: ServingNumerics) -> dict[str, int]:
    """Set the backend that reproduces ``numerics`` on every lowbit layer (LOWBIT: "auto").

    Every quantized layer must be covered: a LowbitError names the first layer whose scheme has no
    emulation of that engine (its numerics would otherwise be lowbit's, silently)."""
    if numerics is ServingNumerics.LOWBIT:
        return use_backend(model, "auto")
    from lowbit.modules import FakeQuantLinear, QuantLinear

    names = SERVING_BACKENDS[numerics]
    for mod in model.modules():
        if isinstance(mod, FakeQuantLinear) or (
                isinstance(mod, QuantLinear) and not any(REGISTRY.get(n).accepts(mod) for n in names)):
            raise LowbitError(f"numerics {numerics.value!r}: no emulation of that engine for layer {mod.name!r} "
                              f"(scheme {mod.scheme.name}); evaluate it with numerics 'lowbit'")
    return REGISTRY.use(model, names)


__all__ = ["BACKENDS", "REGISTRY", "Backend", "BackendSpec", "BackendRegistry", "ReferenceBackend",
           "select_backend", "use_backend", "use_numerics", "SERVING_BACKENDS"]
