"""Adversarial float inputs shared by the bit-exactness tests: every fp16/bf16 pattern, a format's
values with its ties and their float32 neighbours, random values over the whole float32 range."""

import torch


def finite_half_patterns() -> torch.Tensor:
    codes = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = torch.cat([codes.view(torch.float16).float(), codes.view(torch.bfloat16).float()])
    return x[torch.isfinite(x)]


def ties(fmt) -> torch.Tensor:
    """Every representable value, every midpoint between neighbours (the ties), and each of
    them one float32 ulp up and down, both signs, plus values past max_finite."""
    v = fmt.values().double()
    mids = (v[:-1] + v[1:]) / 2
    top = torch.tensor([fmt.max_finite * 1.0625, fmt.max_finite * 2, fmt.max_finite + (v[-1] - v[-2]) / 2])
    base = torch.cat([v, mids, top]).float()
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(0.0))
    x = torch.cat([base, up, down])
    return torch.cat([x, -x])


def wide_random(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.ldexp(torch.rand(n, generator=g) + 0.5, torch.randint(-150, 128, (n,), generator=g).float())
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = mag * sign
    return x[torch.isfinite(x)]
