"""What a source checkpoint's config.json says its weights are (lowbit.modelfree.plan reads
float, FP8 block-scaled and gpt-oss MXFP4-expert sources), and the FP8 block scales' shapes."""

from __future__ import annotations

import math

from lowbit.errors import FormatError
from lowbit.files.tensors import TensorInfo
from lowbit.modelfree.source import Checkpoint
from lowbit.moe import FUSED_ON_DISK


def source_mxfp4_experts(ckpt: Checkpoint) -> bool:
    """gpt-oss's own MXFP4 experts (quant_method "mxfp4" on a family in FUSED_ON_DISK)."""
    qc = ckpt.config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4" and ckpt.get("model_type") in FUSED_ON_DISK


def source_fp8_block(ckpt: Checkpoint) -> tuple[bool, tuple[int, int] | None]:
    qc = ckpt.config.get("quantization_config")
    if not qc or source_mxfp4_experts(ckpt):
        return False, None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise FormatError(
            f"{ckpt.root}/config.json: the source is already quantized (quant_method {method!r}); model-free "
            f"quantization reads float (bf16/fp16/fp32) or FP8 block-scaled ('fp8') checkpoints")
    block = qc.get("weight_block_size")
    if block is None:
        return True, None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise FormatError(f"{ckpt.root}/config.json: weight_block_size {block!r} must be two positive integers")
    return True, (block[0], block[1])


def check_fp8_scale(w: TensorInfo, s: TensorInfo, block: tuple[int, int] | None) -> None:
    if s.numel == 1:
        return
    if block is None or len(s.shape) != 2:
        raise FormatError(f"{s.shard}: {s.name} has shape {list(s.shape)}, but config.json gives no "
                          f"weight_block_size to dequantize {w.name} with")
    want = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    if s.shape != want:
        raise FormatError(f"{s.shard}: {s.name} has shape {list(s.shape)}; {w.name} {list(w.shape)} with "
                          f"blocks {list(block)} needs {list(want)}")
