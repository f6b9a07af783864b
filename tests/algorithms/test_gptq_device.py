"""GPTQ's column loop runs where the weights are: on a GPU the torch loop there (no copy to the
CPU), its scales the CPU's and its codes the CPU's up to the GPU's summation order."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.gptq import gptq_quantize
from lowbit.kernels import Implementation, using
from lowbit.schemes import PRESETS


def _problem(out_f=48, in_f=96):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(out_f, in_f, generator=g) * 0.05
    X = torch.randn(256, in_f, generator=g)
    return W, X.double().T @ X.double()


@pytest.mark.parametrize("scheme", ["nvfp4", "w4a16"])
def test_the_torch_loop_is_the_native_loop_on_the_cpu(scheme):
    """The device-generic torch loop (what a GPU runs) against the C sub-block, on the CPU."""
    W, H = _problem()
    spec = PRESETS[scheme].weights
    a = gptq_quantize(W, H, spec)
    with using(Implementation.TORCH):
        b = gptq_quantize(W, H, spec)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["nvfp4", "w4a16"])
def test_gptq_solves_on_the_gpu(scheme):
    W, H = _problem(256, 512)
    spec = PRESETS[scheme].weights
    cpu = gptq_quantize(W, H, spec)
    gpu = gptq_quantize(W.cuda(), H.cuda(), spec)
    assert gpu.codes.device.type == "cuda"
    assert torch.equal(cpu.scale, gpu.scale.cpu())
    assert (cpu.codes != gpu.codes.cpu()).float().mean() < 1e-3
