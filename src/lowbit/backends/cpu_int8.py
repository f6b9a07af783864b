"""cpu-int8: integer matmul for w8a8-int8 and w8a8-int8-dynamic with exact int32 accumulation.

torch._int_mm is far slower than float32 F.linear on CPUs without VNNI (bench/quantize/RESULTS-quantize.md),
so the integer products are summed by the float32 GEMM instead, exactly: int8 values held in
float32 are exact, every product |a*w| <= 128*128 = 2^14 is exact, and with the inner
dimension cut into chunks of at most 2^24 / 2^14 = 1024 every partial sum, in any order the
GEMM chooses (FMA included), is an integer of magnitude <= 2^24 and so exactly representable
in float32. Chunk results are summed in int32. The accumulator therefore equals the exact
integer dot product (the reference's codes multiplied in int64), and the output is
``float32(acc) * (input_scale * weight_scale) + bias`` (per token: ``(float32(acc) *
input_scale) * weight_scale + bias``), equal to the reference's
F.linear(QDQ(x), dequant(W)) within float32 rounding.

The weight's integer values are decoded to float32 once per layer and kept in a
``lowbit.backends.cache.ModuleCache`` (a reload of the weights rebuilds them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.numerics import INT8, FormatName
from lowbit.backends.cache import ModuleCache
from lowbit.modules.inputs import input_args
from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.quant import int_values
from lowbit.schemes import Dynamic, Granularity, Scheme

EXACT_LIMIT = 1 << 24           # float32 holds every integer up to 2^24
MAX_PRODUCT = 128 * 128         # |int8 * int8| <= 2^14 (-128 * -128)
CHUNK = EXACT_LIMIT // MAX_PRODUCT  # 1024


def supports_scheme(s: Scheme) -> bool:
    w, a = s.weights, s.input_activations
    if a is None:
        return False
    w_ok = (w.format is FormatName.INT8 and w.symmetric and w.granularity in (Granularity.CHANNEL, Granularity.TENSOR))
    a_ok = a.format is FormatName.INT8 and a.symmetric and a.scale_floor is None and (
        (a.granularity is Granularity.TENSOR and a.dynamic is Dynamic.STATIC)
        or (a.granularity is Granularity.TOKEN and a.dynamic is Dynamic.DYNAMIC)
    )
    return w_ok and a_ok


def chunk_bounds(k: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    return [(i, min(k, i + chunk)) for i in range(0, k, chunk)]


def int_matmul_exact(a_vals: torch.Tensor, w_chunks: list[torch.Tensor], bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Exact integer a @ w^T for int8-valued float32 a [M, K] and w chunks [N, k_i].

    Returns float32 when one chunk suffices (its values are exact integers <= 2^24 in
    magnitude), else int32."""
    if len(bounds) == 1:
        return F.linear(a_vals, w_chunks[0])
    acc = None
    for (lo, hi), wc in zip(bounds, w_chunks):
        part = F.linear(a_vals[:, lo:hi], wc).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def int_accumulate(a_vals: torch.Tensor, w_vals: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """int32 accumulators of int8-valued a [M, K] and w [N, K] (float32), the route forward takes."""
    bounds = chunk_bounds(w_vals.shape[1], chunk)
    w_chunks = [w_vals[:, lo:hi].contiguous() for lo, hi in bounds]
    return int_matmul_exact(a_vals.to(torch.float32), w_chunks, bounds).to(torch.int32)


def quantize_input_values(module, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values (as float32) and the scale ([1] or [M, 1]) of a 2-D input: the codes and
    scale of ``lowbit.backends.reference.quantize_input``, bit for bit (lowbit.quant.int_values)."""
    args = input_args(module)
    return int_values(x2, module.scheme.input_activations, args["scale"], args["name"])


def _decoded_weight(module) -> dict:
    """The weight's int8 values in float32, cut into K chunks, and its scales as a row."""
    w_vals = INT8.decode(module.weight_codes)
    bounds = chunk_bounds(module.in_features)
    return {"bounds": bounds, "chunks": [w_vals[:, lo:hi].contiguous() for lo, hi in bounds],
            "w_scale": module.weight_scale.to(torch.float32).reshape(1, -1)}


class CpuInt8Backend:
    name = "cpu-int8"

    def __init__(self) -> None:
        self.shared = SharedInput()  # q/k/v and gate/up quantize their common input once
        self.cache = ModuleCache()

    def _weights(self, module) -> dict:
        return self.cache.get(module, _decoded_weight)

    def accumulators(self, module, x: torch.Tensor) -> torch.Tensor:
        """The int32 accumulators of ``x`` (any leading shape) against the module's weight."""
        st = self._weights(module)
        vals, _ = quantize_input_values(module, x.reshape(-1, x.shape[-1]))
        acc = int_matmul_exact(vals, st["chunks"], st["bounds"])
        return acc.to(torch.int32).reshape(*x.shape[:-1], -1)

    @torch.no_grad()  # integer codes carry no gradient; in-place epilogues need no autograd graph
    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        st = self._weights(module)
        vals, a_scale = self.shared.get(x, input_key(module, "int8"),
                                        lambda: quantize_input_values(module, x.reshape(-1, x.shape[-1])))
        acc = int_matmul_exact(vals, st["chunks"], st["bounds"])
        y = acc if acc.dtype == torch.float32 else acc.to(torch.float32)
        if a_scale.numel() > 1:  # per token: [M, 1], then per channel [1, N]
            y = y.mul_(a_scale)
            scale = st["w_scale"]
        else:
            scale = st["w_scale"] * a_scale
        if module.bias is None:
            y = y.mul_(scale)
        else:  # y * scale + bias in one pass over [M, N]
            y = torch.addcmul(module.bias.to(torch.float32), y, scale, out=y)
        return y.reshape(*x.shape[:-1], module.out_features).to(x.dtype)

    def release(self, module) -> None:
        self.cache.release(module)
