"""Adversarial inputs and bit-exactness checks of the kernels against lowbit's CPU reference.

Used by the interpreter tests (tests/kernels/test_triton_kernels.py) and by bench/gpu/gpu_check.py on a
GPU, so that both run the same cases. Every check compares bit patterns (float32 viewed as
int32), so -0.0 vs +0.0 and NaN payloads count as differences.
"""

from __future__ import annotations

import math

import torch

from lowbit.kernels import gpu
from lowbit.numerics import FormatName, get_format
from lowbit.quant import QuantizedTensor, dequantize, global_scale_from_amax, quantize
from lowbit.schemes import QuantSpec

F32_MAX = torch.finfo(torch.float32).max


def _f(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _nextafter(x: torch.Tensor, toward: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, toward))


def adversarial_blocks(spec: QuantSpec, seed: int = 0, n_random: int = 64) -> torch.Tensor:
    """[n, BS] float32 blocks (BS = spec.group_size) covering the cases where a kernel may
    disagree with the reference: rounding ties of the elements, binade edges and mantissa
    carries of the block scale, subnormal UE5M3 scales and the E8M0 2^-127 scale, all-zero
    blocks (+0.0 and -0.0), float32 subnormal inputs, the largest finite float32 values, and
    random data over a wide exponent range."""
    bs = spec.group_size
    g = torch.Generator().manual_seed(seed)
    elem = get_format(spec.format)
    emax = elem.max_finite
    vals = elem.values()  # sorted non-negative element values
    mids = (vals[1:] + vals[:-1]) / 2  # element rounding ties (exact in float32)
    rows: list[torch.Tensor] = []

    def block_with_amax(amax: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        r = torch.rand(bs, generator=g) * 2 - 1 if fill is None else fill
        b = (r * amax).to(torch.float32)
        b[int(torch.randint(bs, (1,), generator=g))] = amax * (1 if torch.rand(1, generator=g) < 0.5 else -1)
        return b

    # 1. element ties at scales m * 2^k (the block amax is emax * m * 2^k, so the block scale is
    #    exactly m * 2^k where the scale format holds it; m != 1 makes 1/scale inexact, so that a
    #    reciprocal multiply instead of a division misrounds some ties)
    for k in (-20, -3, 0, 1, 7):
        for m in (1.0, 1.25, 1.5, 1.875):
            s = m * 2.0 ** k
            t = torch.cat([mids, -mids, mids + 0, vals]) * s
            t = t[:bs] if t.numel() >= bs else torch.cat([t, torch.zeros(bs - t.numel())])
            t[0] = emax * s
            rows.append(t)
            if m == 1.0:  # just above and below the ties
                rows.append(torch.cat([_f([emax * s]), _nextafter(t[1:], math.inf)]))
                rows.append(torch.cat([_f([emax * s]), _nextafter(t[1:], -math.inf)]))
    # 2. block-scale binade edges and mantissa carries: amax/emax_elem = m * 2^k
    for k in (-26, -18, -17, -15, -14, -13, -10, -9, -7, -6, -1, 0, 5, 8, 15, 16, 17, 60, 120, 125, 126):
        for m in (1.0, 1.0625, 1.875, 1.9375, 1.96875, 1.5, 1.75, 1.4375):
            a = _f(m * 2.0 ** k) * emax
            if not torch.isfinite(a):
                continue
            for aa in (a, _nextafter(a, math.inf), _nextafter(a, 0.0)):
                rows.append(block_with_amax(aa))
    # 3. scales near the UE5M3 saturation (114688) and the E4M3 one (448)
    for top in (114688.0, 122880.0, 448.0, 464.0, 480.0):
        a = _f(top * emax)
        for aa in (a, _nextafter(a, math.inf), _nextafter(a, 0.0)):
            rows.append(block_with_amax(aa))
    # 4. all-zero blocks, with -0.0, and a lone tiny element
    rows.append(torch.zeros(bs))
    rows.append(-torch.zeros(bs))
    z = torch.zeros(bs)
    z[::2] = -0.0
    z[3] = 2.0 ** -140
    rows.append(z)
    # 5. float32 subnormal inputs (E8M0 scale 2^-127) and the smallest normals
    for a in (2.0 ** -149, 2.0 ** -140, 2.0 ** -127, 2.0 ** -126, 2.0 ** -125, 2.0 ** -124, 1.5 * 2.0 ** -120):
        rows.append(block_with_amax(_f(a)))
    sub = (torch.randint(1, 1 << 23, (bs,), generator=g, dtype=torch.int32)).view(torch.float32)
    rows.append(torch.where(torch.rand(bs, generator=g) < 0.5, sub, -sub))
    # 6. the largest finite values
    rows.append(block_with_amax(_f(F32_MAX)))
    rows.append(torch.full((bs,), F32_MAX) * torch.where(torch.rand(bs, generator=g) < 0.5, 1.0, -1.0))
    rows.append(block_with_amax(_f(F32_MAX / 2)))
    # 7. random data: wide exponents per element and per block
    for _ in range(n_random):
        e = torch.randint(-140, 126, (1,), generator=g).item()
        spread = torch.randint(0, 40, (1,), generator=g).item()
        mag = torch.exp2(torch.rand(bs, generator=g) * -spread + e)
        sign = torch.where(torch.rand(bs, generator=g) < 0.5, 1.0, -1.0)
        rows.append((mag * sign).to(torch.float32))
    x = torch.stack([r.to(torch.float32).reshape(bs) for r in rows])
    assert bool(torch.isfinite(x).all())
    return x


def global_scales(x: torch.Tensor, spec: QuantSpec) -> list[torch.Tensor | None]:
    """Global scales to test an NVFP4-style spec with (None where the spec has none)."""
    if not spec.global_scale:
        return [None]
    amax = x.abs().amax()
    return [global_scale_from_amax(amax, spec), _f([1.0]), _f([2.0 ** 10]), _f([3.0]),
            global_scale_from_amax(amax * 0.37, spec)]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.float32) if t.dtype not in (torch.float32,) else t
    return t.contiguous().view(torch.int32)


def count_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (float tensors compared as float32 bit patterns)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    if a.is_floating_point():
        if a.dtype != b.dtype:
            return max(a.numel(), 1)
        if a.dtype == torch.float32:
            return int((bits(a) != bits(b)).sum())
        return int((a.view(torch.int16) != b.view(torch.int16)).sum())
    return int((a != b).sum())


def check_block_quant(spec: QuantSpec, x: torch.Tensor, device: str | torch.device,
                      qdq_dtypes=(torch.float32, torch.bfloat16), **kernel_kw) -> dict[str, int]:
    """Mismatch counts of quantize_blocks against lowbit.quant on the CPU, per global scale."""
    out: dict[str, int] = {}
    xr = x.reshape(-1, spec.group_size * 2) if x.shape[0] % 2 == 0 else x
    for i, gs in enumerate(global_scales(x, spec)):
        ref = quantize(xr, spec, global_scale=gs)
        fq = dequantize(ref)
        got = gpu.quantize_blocks(xr.to(device), spec, None if gs is None else gs.to(device), qdq_dtype=torch.float32,
                              **kernel_kw)
        out[f"g{i}.codes"] = count_diff(got["codes"], ref.codes)
        out[f"g{i}.scale"] = count_diff(got["scale"], ref.scale)
        out[f"g{i}.scale_codes"] = count_diff(got["scale_codes"], ref.scale_codes())
        out[f"g{i}.qdq_f32"] = count_diff(got["qdq"], fq)
        for dt in qdq_dtypes:
            if dt == torch.float32:
                continue
            q2 = gpu.quantize_blocks(xr.to(device), spec, None if gs is None else gs.to(device), codes=False, qdq_dtype=dt,
                                 **kernel_kw)
            out[f"g{i}.qdq_{str(dt).split('.')[-1]}"] = count_diff(q2["qdq"], fq.to(dt))
    return out


def check_row_quant(spec: QuantSpec, x: torch.Tensor, device, scales=(None,), **kernel_kw) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, sc in enumerate(scales):
        ref = quantize(x, spec, scale=sc)
        codes, s = gpu.quantize_rows(x.to(device), spec, None if sc is None else sc.to(device), **kernel_kw)
        out[f"s{i}.codes"] = count_diff(codes, ref.codes)
        out[f"s{i}.scale"] = count_diff(s, ref.scale)
    return out


def random_microscaled_weight(spec: QuantSpec, out_f: int, in_f: int, seed: int = 0) -> QuantizedTensor:
    """Random element codes and random block-scale codes over the whole finite range (the
    E8M0 2^-127 code and zero scales included), as a QuantizedTensor."""
    g = torch.Generator().manual_seed(seed)
    elem = get_format(spec.format)
    sfmt = get_format(spec.scale_format)
    fc = elem.finite_codes()
    codes = fc[torch.randint(fc.numel(), (out_f, in_f), generator=g)]
    sc = sfmt.finite_codes()
    G = in_f // spec.group_size
    scodes = sc[torch.randint(sc.numel(), (out_f, G), generator=g)]
    scodes[0, :] = sc[: G] if G <= sc.numel() else scodes[0, :]
    scale = sfmt.decode(scodes)
    gs = _f([2688.0 / 3.7]) if spec.global_scale else None
    return QuantizedTensor(codes, scale, spec, None, gs)


def check_microscaled_dequant(qt: QuantizedTensor, device, dtypes=(torch.float32, torch.bfloat16),
                              **kernel_kw) -> dict[str, int]:
    data, scodes = gpu.pack_microscaled(qt.codes, qt.scale, qt.spec)
    out: dict[str, int] = {}
    N, K = qt.codes.shape
    for dt in dtypes:
        got = gpu.dequantize_microscaled(data.to(device), scodes.to(device), qt.spec,
                                     None if qt.global_scale is None else qt.global_scale.to(device),
                                     out_features=N, in_features=K, dtype=dt, **kernel_kw)
        out[f"dequant_{str(dt).split('.')[-1]}"] = count_diff(got, dequantize(qt, dt))
    return out


def check_int_dequant(qt: QuantizedTensor, device, dtypes=(torch.float32, torch.bfloat16),
                      **kernel_kw) -> dict[str, int]:
    data = gpu.pack_int(qt.codes, qt.spec)
    N, K = qt.codes.shape
    out: dict[str, int] = {}
    for dt in dtypes:
        got = gpu.dequantize_int(data.to(device), qt.scale.to(device), qt.spec,
                             None if qt.zero_point is None else qt.zero_point.to(device),
                             out_features=N, in_features=K, dtype=dt, **kernel_kw)
        out[f"dequant_{str(dt).split('.')[-1]}"] = count_diff(got, dequantize(qt, dt))
    return out


def adversarial_rows(spec: QuantSpec, K: int = 96, seed: int = 0) -> tuple[torch.Tensor, list]:
    """[n, K] rows for per-token / per-tensor INT8 and FP8 quantization, and static scales to
    try: rows whose x/scale lands on rounding ties (k + 0.5 for INT8, E4M3 midpoints), just
    beside them, -0.0, float32 subnormals, the largest finite values, saturating outliers
    (static scales), an all-zero row and random rows over a wide exponent range."""
    g = torch.Generator().manual_seed(seed)
    elem = get_format(spec.format)
    qmax = elem.max_finite
    if spec.format is FormatName.INT8:
        ties = torch.arange(-128, 128, dtype=torch.float32) + 0.5
    else:
        v = elem.values()
        m = (v[1:] + v[:-1]) / 2
        ties = torch.cat([m, -m])
    rows = []
    for k in (-30, -3, 0, 4, 90):
        s = 2.0 ** k
        t = ties[torch.randint(ties.numel(), (K,), generator=g)] * s
        t[0] = qmax * s  # amax / qmax == s exactly
        rows += [t, torch.cat([t[:1], _nextafter(t[1:], math.inf)]), torch.cat([t[:1], _nextafter(t[1:], -math.inf)])]
    z = torch.zeros(K)
    z[1::3] = -0.0
    rows.append(z)
    sub = torch.randint(1, 1 << 23, (K,), generator=g, dtype=torch.int32).view(torch.float32)
    rows.append(torch.where(torch.rand(K, generator=g) < 0.5, sub, -sub))
    rows.append(torch.full((K,), F32_MAX) * torch.where(torch.rand(K, generator=g) < 0.5, 1.0, -1.0))
    for _ in range(8):
        e = torch.randint(-140, 120, (1,), generator=g).item()
        mag = torch.exp2(torch.rand(K, generator=g) * -30 + e)
        rows.append(mag * torch.where(torch.rand(K, generator=g) < 0.5, 1.0, -1.0))
    x = torch.stack([r.to(torch.float32) for r in rows])
    scales = [_f([1.0]), _f([2.0 ** -3]), _f([0.0371]), _f([3.0e-39])]  # the last is a float32 subnormal
    return x, scales
