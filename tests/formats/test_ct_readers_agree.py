"""lowbit.load and stock transformers + compressed-tensors read lowbit's compressed-tensors
folders to the same perplexity, within lowbit's own spread under perturbations of the input
embeddings at the model dtype's resolution (what float rounding alone moves), for every scheme
lowbit writes in that format, on the tiny Llama with outlier input channels.

The stock reader runs in a subprocess that never imports lowbit (helpers.ct_client.CLIENT).
On SmolLM2 the same comparison (bench/serve/ct_readers.py, bench/peers/RESULTS.md) is the evidence for what
the readers' differences are: noise of a model that static INT8 inputs make chaotic, not bias.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from helpers.ct_client import CLIENT
from helpers.formats_support import quantized_model

pytest.importorskip("compressed_tensors")

# scheme -> the dtype stock transformers loads it in (the MX and NVFP4 layouts decompress to bf16 only)
SCHEMES = {"w8a8-int8": torch.float32, "w8a8-int8-dynamic": torch.float32, "w8a8-fp8": torch.float32,
           "w8a8-fp8-dynamic": torch.float32, "w4a16": torch.float32, "w8a16": torch.float32,
           "mxfp4": torch.bfloat16, "mxfp8": torch.bfloat16, "nvfp4a16": torch.bfloat16, "nvfp4": torch.bfloat16}
SEEDS = 6
# Where the readers' rules differ, so their perplexities do too (checked below, not skipped):
# compressed-tensors computes a dynamic symmetric INT8 scale as amax / ((qmax - qmin) / 2) =
# amax / 127.5 at run time; lowbit (and vLLM's int8 kernels) use amax / 127.
RULE_DIFFERS = {"w8a8-int8-dynamic"}


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return math.exp(-float(lp.gather(2, ids[:, 1:, None]).mean()))


@torch.no_grad()
def _lowbit_ppls(folder, ids, dtype) -> tuple[float, list[float]]:
    model = lowbit.load(folder)
    plain = _ppl(model(ids).logits, ids)
    eps = torch.finfo(dtype).eps
    spread = []
    for seed in range(SEEDS):
        e = model.get_input_embeddings()(ids)
        noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(seed)).to(e.dtype)
        spread.append(_ppl(model(inputs_embeds=e * (1 + eps * noise)).logits, ids))
    return plain, spread


@pytest.mark.subprocess
def test_stock_reader_and_lowbit_agree_within_lowbit_spread(tmp_path):
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(11))
    folders, ours = {}, {}
    for name, dtype in SCHEMES.items():
        model = quantized_model(name, dtype=dtype, hidden_size=128, intermediate_size=256)
        lowbit.save(model, tmp_path / name, format="compressed-tensors")
        folders[name] = (str(tmp_path / name), str(dtype).removeprefix("torch."))
        ours[name] = _lowbit_ppls(tmp_path / name, ids, dtype)
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    jobs = {"ids": str(tmp_path / "ids.safetensors"), "out": str(tmp_path / "logits.safetensors"), "folders": folders}
    p = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(tmp_path / "logits.safetensors"))
    for name in SCHEMES:
        plain, spread = ours[name]
        stock = _ppl(got[name], ids)
        sd = statistics.stdev(spread + [plain])
        bound = 3 * sd + 1e-6 * plain
        print(f"{name}: lowbit {plain:.6f} (spread sd {sd:.2e}), stock {stock:.6f}, |diff| {abs(stock - plain):.2e}")
        if name in RULE_DIFFERS:
            assert abs(stock - plain) > bound, (name, "agrees now: drop it from RULE_DIFFERS")
        else:
            assert abs(stock - plain) <= bound, (name, plain, stock, sd)


def test_compressed_tensors_dynamic_int8_scale_rule_is_half_step():
    """The fact RULE_DIFFERS rests on, read off compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    from lowbit.quant import quantize

    x = torch.tensor([[0.3, -2.54, 1.0, 0.01]])
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    amax = x.abs().amax(dim=-1)
    theirs, _ = calculate_qparams(-amax, amax, args)
    assert torch.allclose(theirs.flatten(), amax / 127.5)
    ours = quantize(x, lowbit.get_scheme("w8a8-int8-dynamic").input_activations).scale
    assert torch.equal(ours.flatten(), amax / 127)
