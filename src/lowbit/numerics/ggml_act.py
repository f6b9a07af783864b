"""How llama.cpp's CPU backend rounds a matmul's activations before its dot products: pure functions.

ggml's CPU matmul of a weight of type T with float32 activations first converts every activation
row to T's ``vec_dot_type`` (``ggml-cpu.c``, ``type_traits_cpu``) and then takes dot products of
the two encodings. The values those dot products see are computed here (``DotInput``):

| weight types | activations become | per block | value |
|---|---|---|---|
| F32 | F32 | - | x |
| F16 / BF16 | F16 / BF16 | - | x rounded to nearest even |
| Q8_0, Q4_0, Q5_0, MXFP4, NVFP4 | Q8_0 | 32 | fp16(d) * q |
| Q4_1, Q5_1 | Q8_1 | 32 | fp16(d) * q, and s = fp16(d * sum q) |
| Q2_K ... Q6_K | Q8_K | 256 | d * q |

- Q8_0 / Q8_1 are the x86 AVX/AVX2 conversion (``arch/x86/quants.c`` ``quantize_row_q8_0`` / ``_q8_1``),
  which is *not* the reference ``quantize_row_q8_0_ref``: ``d = amax / 127`` (float32),
  ``q = rne(x * (127 / amax))`` (the multiplier is ``127 / amax`` rounded to float32, 0 for a zero
  block; ``_mm256_round_ps`` rounds half to even), saturated to int8; only ``fp16(d)`` is stored.
  Q8_1 also stores ``s = fp16(d * sum(q))`` with the float32 ``d``, which the Q4_1 / Q5_1 dot
  products use for the block's min term (``m * s``) instead of ``fp16(d) * sum(q)``.
- Q8_K (``quantize_row_q8_K_ref``, which the x86 build calls): per 256 weights the element of largest
  magnitude ``max`` (the first on a tie, sign kept), ``iscale = -127 / max``,
  ``q = min(127, nearest_int(iscale * x))`` (``nearest_int``: round half to even of the float32
  product), ``d = 1 / iscale``, float32; a zero block is all zero.

The rest of a dot product (integer sums, then float32 sums of block terms) is exact up to the float
summation order, so ``x_values @ decode(W).T`` is llama.cpp's result to within float summation.
"""

from __future__ import annotations

import enum

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GgmlType

Q8_BLOCK = 32
Q8_K_BLOCK = 256


class DotInput(str, enum.Enum):
    """The type ggml's CPU backend converts a matmul's activations to (``vec_dot_type``)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q8_1 = "q8_1"
    Q8_K = "q8_k"


#: vec_dot_type of every GGML weight type lowbit decodes (ggml-cpu.c type_traits_cpu)
VEC_DOT = {GgmlType.Q8_0: DotInput.Q8_0, GgmlType.Q4_0: DotInput.Q8_0, GgmlType.Q5_0: DotInput.Q8_0,
           GgmlType.MXFP4: DotInput.Q8_0, GgmlType.NVFP4: DotInput.Q8_0, GgmlType.Q4_1: DotInput.Q8_1,
           GgmlType.Q5_1: DotInput.Q8_1, GgmlType.Q2_K: DotInput.Q8_K, GgmlType.Q3_K: DotInput.Q8_K,
           GgmlType.Q4_K: DotInput.Q8_K, GgmlType.Q5_K: DotInput.Q8_K, GgmlType.Q6_K: DotInput.Q8_K}
BLOCK = {DotInput.Q8_0: Q8_BLOCK, DotInput.Q8_1: Q8_BLOCK, DotInput.Q8_K: Q8_K_BLOCK}


def _blocks(x: torch.Tensor, block: int, kind: DotInput) -> torch.Tensor:
    if x.shape[-1] % block:
        raise QuantizationError(f"{kind.value} activations need rows of whole blocks of {block}, got {x.shape[-1]}")
    return x.detach().to(torch.float32).reshape(-1, block)


def q8_0_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x86 ``quantize_row_q8_0`` of ``x`` [..., K]: (codes int32 [N, 32], float32 d [N]) per block of 32,
    d not yet rounded to fp16 (Q8_1's sum uses it as it is)."""
    b = _blocks(x, Q8_BLOCK, DotInput.Q8_0)
    amax = b.abs().amax(dim=1)
    d = amax / 127.0
    safe = torch.where(amax == 0, torch.ones_like(amax), amax)
    mul = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / safe)
    q = torch.round(b * mul[:, None]).clamp(-128, 127).to(torch.int32)
    return q, d


def q8_k_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_row_q8_K_ref`` of ``x`` [..., K]: (codes int32 [N, 256], float32 d [N]) per block of 256."""
    b = _blocks(x, Q8_K_BLOCK, DotInput.Q8_K)
    top = b.gather(1, b.abs().argmax(dim=1, keepdim=True)).squeeze(1)   # argmax: the first on a tie
    zero = top == 0
    safe = torch.where(zero, torch.ones_like(top), top)
    iscale = torch.full_like(top, -127.0) / safe
    q = torch.round(b * iscale[:, None]).clamp(max=127)
    q = torch.where(zero[:, None], torch.zeros_like(q), q).to(torch.int32)
    d = torch.where(zero, torch.zeros_like(top), torch.ones_like(iscale) / iscale)
    return q, d


def dot_input_values(x: torch.Tensor, kind: DotInput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activations ``x`` [..., K] (float) as llama.cpp's dot products see them after conversion
    to ``kind``: (float32 values [..., K], Q8_1's stored block sums ``s`` [..., K / 32] or None)."""
    kind = DotInput(kind)
    lead = x.shape[:-1]
    if kind is DotInput.F32:
        return x.to(torch.float32), None
    if kind in (DotInput.F16, DotInput.BF16):
        dt = torch.float16 if kind is DotInput.F16 else torch.bfloat16
        return x.to(torch.float32).to(dt).to(torch.float32), None
    if kind is DotInput.Q8_K:
        q, d = q8_k_codes(x)
        return (q.to(torch.float32) * d[:, None]).reshape(*lead, -1), None
    q, d = q8_0_codes(x)
    d16 = d.to(torch.float16).to(torch.float32)
    values = (q.to(torch.float32) * d16[:, None]).reshape(*lead, -1)
    if kind is DotInput.Q8_0:
        return values, None
    s = (d * q.sum(dim=1).to(torch.float32)).to(torch.float16).to(torch.float32)
    return values, s.reshape(*lead, -1)
