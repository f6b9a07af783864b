"""The weights the automatic choice measures each candidate with: those its calibration rounds
to (GPTQ's on the float model's Hessians for GPTQ candidates, round to nearest for the others)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.algorithms.gptq import gptq_quantize_groups
from lowbit.calibration.config import CalibrationConfig
from lowbit.calibration.hessian import HessianSum
from lowbit.fusion import shared_weight_global_scales
from lowbit.modules import QuantLinear
from lowbit.recipes.rounded import calibrated_weights, quantized_weights
from lowbit.schemes import PRESETS

CALIB = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(5))
DIMS = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256}
QKV = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]


def test_gptq_candidates_are_measured_with_gptq_weights_on_the_float_hessians():
    m = tiny_llama(**DIMS)
    names = QKV + ["model.layers.1.mlp.down_proj"]
    nv, int8 = PRESETS["nvfp4"], PRESETS["w8a8-int8"]
    cfg = CalibrationConfig()
    got, rounding = calibrated_weights(m, names, [nv, int8], CALIB, None, cfg)
    assert rounding == {"nvfp4": "gptq", "w8a8-int8": "rtn"}
    rtn = quantized_weights(m, names, int8)
    assert all(torch.equal(got["w8a8-int8"][n], rtn[n]) for n in names)  # RTN candidates: RTN weights

    seen = {}  # the float model's inputs, window by window, by hand
    hooks = [m.get_submodule(n).register_forward_hook(lambda mod, a, y, n=n: seen.setdefault(n, []).append(a[0][0]))
             for n in (QKV[0], names[3])]
    with torch.no_grad():
        for i in range(CALIB.shape[0]):
            m(input_ids=CALIB[i:i + 1])
    for h in hooks:
        h.remove()
    hess = {}
    for n, xs in seen.items():
        h = HessianSum()
        for x in xs:
            h.add(x)
        hess[n] = h.upper()
    weights = {n: m.get_submodule(n).weight for n in names}
    gs = shared_weight_global_scales(weights, nv)
    want = gptq_quantize_groups([[weights[n] for n in QKV], [weights[names[3]]]], [hess[QKV[0]], hess[names[3]]],
                                nv.weights, global_scales=[[gs.get(n) for n in QKV], [gs.get(names[3])]],
                                options=cfg.gptq_options(nv), names=[[f"{n}.weight" for n in QKV], ["d.weight"]])
    for n, qt in zip(names, want[0] + want[1]):
        w = QuantLinear.from_quantized(qt, nv, name=n).dequantized_weight()
        assert torch.allclose(got["nvfp4"][n], w, rtol=0, atol=1e-6)
    # GPTQ's weights lose less of the layer's output than round to nearest on the same inputs
    x = torch.cat(seen[names[3]])
    w0 = weights[names[3]].detach()
    rtn_nv = quantized_weights(m, names, nv)[names[3]]
    assert ((x @ (got["nvfp4"][names[3]] - w0).T) ** 2).sum() < ((x @ (rtn_nv - w0).T) ** 2).sum()


def test_auto_recipe_follows_the_rounding_the_quantization_uses():
    m = tiny_llama(**DIMS)
    r = lowbit.auto_recipe(m, "nvfp4,w8a8-int8", 6, CALIB, num_samples=3, seq_len=48)
    assert r.rounding == {"nvfp4": "gptq", "w8a8-int8": "rtn"}
    r = lowbit.auto_recipe(m, "nvfp4,w8a8-int8", 6, CALIB, num_samples=3, seq_len=48, weight_rounding="rtn")
    assert r.rounding == {"nvfp4": "rtn", "w8a8-int8": "rtn"}
