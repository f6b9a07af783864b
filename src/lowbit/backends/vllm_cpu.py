"""vllm-cpu-int8 and vllm-cpu-fp8: w8a8-int8 (static and dynamic) and w8a8-fp8-dynamic computed as
vLLM's CPU build serves them.

Not an automatic backend: ``lowbit.load(path, numerics=ServingNumerics.VLLM_CPU)`` sets it (with
the model in bfloat16), so that ``lowbit eval --numerics vllm-cpu`` reports what vLLM users get.
The codes come from ``lowbit.quant.serving.quant_codes_vllm_cpu`` (x times the rounded
reciprocal of the scale), the accumulators from the cpu-int8 route (exact int32,
lowbit.backends.cpu_int8.int_matmul_exact) plus ``pair_saturation`` (oneDNN's saturating int16
pair sums on AVX2, where ``lowbit.quant.serving.accumulation`` says the engine takes that path), the output from ``epilogue_vllm_cpu`` (oneDNN's scale order, bf16 output,
truncated on the dynamic path). vllm-cpu-fp8: per-token values from ``quant_values_vllm_cpu_fp8``,
the float32 GEMM of the E4M3 values, ``epilogue_vllm_cpu_fp8``. Every op is documented, with its vLLM
source, in lowbit.quant.serving.
"""

from __future__ import annotations

import torch

from lowbit.backends.cache import ModuleCache
from lowbit.backends.cpu_int8 import _decoded_weight, int_matmul_exact, supports_scheme
from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.modules.inputs import input_args
from lowbit.numerics import E4M3, INT8, FormatName
from lowbit.quant.serving import (Accumulation, CpuIsa, accumulation, epilogue_vllm_cpu, epilogue_vllm_cpu_fp8, is_fp8_token_spec,
                                  pair_saturation, quant_codes_vllm_cpu, quant_values_vllm_cpu_fp8, saturating_pairs)
from lowbit.schemes import Dynamic, Granularity, Scheme

__all__ = ["VllmCpuInt8Backend", "VllmCpuInt8Avx512Backend", "VllmCpuFp8Backend", "supports_scheme",
           "supports_fp8_dynamic"]


def _weights(module) -> dict:
    """cpu-int8's decoded weight, plus the weight pairs whose vpmaddubsw sum can saturate."""
    st = _decoded_weight(module)
    st["pairs"] = saturating_pairs(INT8.decode(module.weight_codes))
    return st


class VllmCpuInt8Backend:
    """``isa``: the host instruction set whose kernels are reproduced (AVX2: saturating int16 pair
    sums on the dynamic path, truncating bf16 stores; AVX-512 + VNNI: exact sums, bf16 to nearest)."""

    name = "vllm-cpu-int8"

    def __init__(self, isa: CpuIsa = CpuIsa.AVX2) -> None:
        self.isa = isa
        self.shared = SharedInput()  # q/k/v and gate/up: one quantization of their common input
        self.cache = ModuleCache()

    def _inputs(self, module, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args = input_args(module)
        return quant_codes_vllm_cpu(x2, module.scheme.input_activations, args["scale"])

    @torch.no_grad()
    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        st = self.cache.get(module, _weights)
        x2 = x.reshape(-1, x.shape[-1])
        vals, a_scale = self.shared.get(x, input_key(module, "vllm-cpu-int8"), lambda: self._inputs(module, x2))
        acc = int_matmul_exact(vals, st["chunks"], st["bounds"]).to(torch.int32)
        dynamic = module.scheme.input_activations.dynamic is Dynamic.DYNAMIC
        if accumulation(dynamic, x.dtype, self.isa) is Accumulation.PAIRS_INT16:
            acc += pair_saturation(vals, st["pairs"], module.out_features)
        y = epilogue_vllm_cpu(acc, a_scale, st["w_scale"], module.bias, x.dtype, dynamic=dynamic, isa=self.isa)
        return y.reshape(*x.shape[:-1], module.out_features)

    def release(self, module) -> None:
        self.cache.release(module)


class VllmCpuInt8Avx512Backend(VllmCpuInt8Backend):
    name = "vllm-cpu-avx512-int8"

    def __init__(self) -> None:
        super().__init__(CpuIsa.AVX512_VNNI)


def supports_fp8_dynamic(s: Scheme) -> bool:
    """E4M3 per-channel weights (float32 scales) with dynamic per-token E4M3 inputs: what vLLM-CPU's
    channel-wise torch FP8 kernel runs."""
    w = s.weights
    return (w.format is FormatName.E4M3 and w.granularity is Granularity.CHANNEL and w.symmetric
            and w.scale_format is FormatName.FP32 and is_fp8_token_spec(s.input_activations))


def _fp8_weights(module) -> dict:
    return {"w8": E4M3.decode(module.weight_codes).to(torch.float8_e4m3fn).contiguous(),
            "w_scale": module.weight_scale.to(torch.float32).reshape(-1)}


_ONE = torch.ones(1, dtype=torch.float32)
FP8_TOKEN_PADDING = 17  # vLLM 0.32 TorchFP8ScaledMMLinearKernel.get_output_padding (eager mode)


class VllmCpuFp8Backend:
    name = "vllm-cpu-fp8"

    def __init__(self) -> None:
        self.shared = SharedInput()  # q/k/v and gate/up: one quantization of their common input
        self.cache = ModuleCache()

    @torch.no_grad()
    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        st = self.cache.get(module, _fp8_weights)
        x2 = x.reshape(-1, x.shape[-1])
        vals, a_scale = self.shared.get(x, input_key(module, "vllm-cpu-fp8"),
                                        lambda: quant_values_vllm_cpu_fp8(x2, module.scheme.input_activations))
        # the GEMM vLLM calls: torch._scaled_mm with unit scales on the tokens padded with zero rows to
        # at least FP8_TOKEN_PADDING (its get_output_padding), whose summation order depends on the row
        # count (one decoded row alone: 1389 of 1536 outputs differ from the same row among 17)
        m = vals.shape[0]
        a8 = torch.nn.functional.pad(vals, (0, 0, 0, max(0, FP8_TOKEN_PADDING - m))).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a8, st["w8"].t(), scale_a=_ONE, scale_b=_ONE, out_dtype=torch.float32)[:m]
        y = epilogue_vllm_cpu_fp8(y, a_scale, st["w_scale"], module.bias, x.dtype)
        return y.reshape(*x.shape[:-1], module.out_features)

    def release(self, module) -> None:
        self.cache.release(module)
