"""What vLLM-CPU computes for a compressed-tensors W4A8 INT folder (lowbit's w4a8-int8): its kernel
on x86 (``Dynamic4bitLinearKernel``) packs the INT4 weights with ``torch.ops.aten._dyn_quant_pack_4bit_weight``
(group-wise scales cast to bfloat16, per-channel scales kept in float32) and calls
``torch.ops.aten._dyn_quant_matmul_4bit``, which quantizes each activation row to int8
**asymmetrically** (scale (max - min) / 255 over [min(x, 0), max(x, 0)], a zero point), where
lowbit's w4a8-int8 means symmetric per-token int8 (amax / 127). This script calls the op on
chosen tensors and compares it with the candidate formulas; run it with vLLM's venv:

    .venv-vllm/bin/python bench/serve/serve_ops_w4a8.py

Prints, per weight layout (group 128, per channel), the largest relative difference of the op's
output from: the float matmul of the dequantized weights, symmetric per-token int8 inputs, and
asymmetric per-token int8 inputs (bench/serve/RESULTS-serve.md holds the figures).
"""

from __future__ import annotations

import torch


def main() -> None:
    torch.manual_seed(0)
    K, N, M, G = 256, 64, 8, 128
    codes = torch.randint(-8, 8, (N, K), dtype=torch.int32)
    scales = torch.rand(N, K // G) * 0.02 + 0.001
    x = torch.randn(M, K) * 3
    x[:, 5] = 40.0  # an outlier channel, as LLM activations have
    for g in (G, K):
        packed = codes.add(8)
        u8 = (packed[:, 1::2] << 4 | packed[:, ::2]).to(torch.uint8)
        sc = scales.to(torch.bfloat16) if g != K else scales[:, :1].float()
        w = torch.ops.aten._dyn_quant_pack_4bit_weight(u8, sc, None, g, K, N)
        y = torch.ops.aten._dyn_quant_matmul_4bit(x, w, g, K, N)
        W = codes.float() * sc.float().repeat_interleave(g, dim=1)[:, :K]
        s = x.abs().amax(1, keepdim=True) / 127
        sym = (torch.round(x / s).clamp(-128, 127) * s) @ W.T
        lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
        sa = (hi - lo) / 255
        zp = torch.round(-128 - lo / sa)
        asym = ((torch.round(x / sa) + zp).clamp(-128, 127) - zp) * sa @ W.T
        for name, ref in (("float inputs", x @ W.T), ("symmetric per-token int8", sym),
                          ("asymmetric per-token int8", asym)):
            rel = float((y - ref).abs().max() / ref.abs().max())
            print(f"{'group ' + str(g) if g != K else 'per channel'}: op vs {name}: max rel. difference {rel:.3g}")


if __name__ == "__main__":
    main()
