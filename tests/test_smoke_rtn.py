"""Round-to-nearest quantization of a tiny Llama with every calibration-free preset."""

import copy

import pytest

import lowbit
from lowbit.errors import QuantizationError
from lowbit.modules import QuantLinear
from lowbit.schemes import PRESETS

# relative logit error bounds for the tiny random model (measured 0.031, 0.062, 0.131, 0.230, 0.285, 0.082, 0.194, 0.0094; ~1.5x margin)
BOUNDS = {"w8a8-int8-dynamic": 0.045, "w8a8-fp8-dynamic": 0.09, "nvfp4a16": 0.2, "nvfp4-e5m3": 0.33,
          "mxfp4": 0.42, "mxfp8": 0.12, "w4a16": 0.28, "w8a16": 0.015}


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
def test_rtn_logits_close(llama, token_ids, scheme):
    ref = llama(token_ids).logits
    q = lowbit.quantize(copy.deepcopy(llama), scheme)
    n_q = sum(isinstance(m, QuantLinear) for m in q.modules())
    assert n_q == 2 * 7  # q,k,v,o,gate,up,down per layer; lm_head stays float
    out = q(token_ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < BOUNDS[scheme]


def test_static_scheme_needs_calibration(llama):
    with pytest.raises(QuantizationError, match="needs calibration"):
        lowbit.quantize(llama, "w8a8-int8")


def test_nvfp4_global_scale_shared_by_fused_siblings(llama):
    q = lowbit.quantize(llama, "nvfp4a16")
    attn = q.model.layers[0].self_attn
    mlp = q.model.layers[0].mlp
    assert attn.q_proj.weight_global_scale == attn.k_proj.weight_global_scale == attn.v_proj.weight_global_scale
    assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale
    assert PRESETS["nvfp4a16"].weights.global_scale
