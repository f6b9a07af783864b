"""ServingNumerics.VLLM_CPU on w8a8-fp8-dynamic: vLLM-CPU's per-token FP8 quantization and its
channel-wise torch._scaled_mm kernel, reproduced bit for bit by lowbit.quant.serving and the
vllm-cpu-fp8 backend (the vLLM side is written out here from its source, with torch's own float8
cast and torch._scaled_mm, so the two implementations are independent)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from lowbit.errors import LowbitError
from lowbit.numerics import E4M3, FormatName
from lowbit.quant.serving import ServingNumerics, epilogue_vllm_cpu_fp8, quant_values_vllm_cpu_fp8
from lowbit.schemes import Dynamic, Granularity, QuantSpec

TOKEN = QuantSpec(FormatName.E4M3, Granularity.TOKEN, dynamic=Dynamic.DYNAMIC)
FP8_MAX = 448.0


def vllm_quant_fp8(x: torch.Tensor):
    """vLLM 0.32 QuantFP8.forward_native, dynamic per token, as written there."""
    x_max = x.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)
    scale = (x_max / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    out = (x.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-FP8_MAX, FP8_MAX)
    return out.to(torch.float8_e4m3fn), scale


def vllm_channelwise(a8, a_scale, w8, w_scale, bias, out_dtype):
    """vLLM 0.32 ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm (weights [N, K])."""
    one = torch.ones(1, dtype=torch.float32)
    y = torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    y = y * a_scale * w_scale.reshape(-1, 1).t()
    if bias is not None:
        y = y + bias
    return y.to(out_dtype)


def adversarial_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 96, generator=g) * 3]
    # every code's value and every midpoint between neighbours, under a row amax of 448 (scale 1)
    vals = E4M3.values()
    mids = (vals[1:] + vals[:-1]) / 2
    edge = torch.cat([vals, mids, -vals, -mids, torch.tensor([FP8_MAX])])
    edge = torch.nn.functional.pad(edge, (0, (-edge.numel()) % 96)).reshape(-1, 96)
    edge[:, 0] = FP8_MAX
    rows.append(edge)
    tie = torch.zeros(1, 96)  # amax 13: 1.21875 / s = 42.0 exactly (a tie: even 40), 1.21875 * (1 / s) > 42
    tie[0, :4] = torch.tensor([13.0, 1.21875, 2.4375, 4.875])
    rows.append(tie)
    rows.append(torch.full((1, 96), 1e-30))   # below the scale floor
    rows.append(torch.zeros(1, 96))
    return torch.cat(rows).to(torch.bfloat16)


def test_fp8_values_are_vllms_bit_for_bit():
    x = adversarial_rows()
    v, s = quant_values_vllm_cpu_fp8(x, TOKEN)
    q8, vs = vllm_quant_fp8(x)
    assert torch.equal(s, vs)
    assert torch.equal(v, q8.to(torch.float32))
    assert v.abs().max().item() == FP8_MAX and bool(torch.isfinite(v).all())
    # against lowbit's meaning (x / s): the reciprocal product flips a few near-ties only
    s_l = x.to(torch.float32).abs().amax(-1, keepdim=True) / FP8_MAX
    lv = E4M3.qdq(torch.where(s_l > 0, x.to(torch.float32) / s_l, torch.zeros(())))
    n = x.shape[0] - 2  # the floor and zero rows aside
    diff = (v[:n] != lv[:n]).nonzero().tolist()
    assert diff == [[n - 1, 1], [n - 1, 2], [n - 1, 3]]  # random rows and scale-1 ties agree; the tie row not
    assert v[n - 1, 1:4].tolist() == [44.0, 88.0, 176.0] and lv[n - 1, 1:4].tolist() == [40.0, 80.0, 160.0]
    assert s[-2].item() == pytest.approx(1 / (448 * 512)) and v[-2:].abs().sum() == 0


def test_fp8_epilogue_is_vllms_channelwise_kernel():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 160, generator=g) * 2).to(torch.bfloat16)
    w8 = (torch.randn(48, 160, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scale = torch.rand(48, generator=g) * 0.01 + 1e-4
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    a8, a_s = vllm_quant_fp8(x)
    want = vllm_channelwise(a8, a_s, w8, w_scale, bias, torch.bfloat16)
    v, s = quant_values_vllm_cpu_fp8(x, TOKEN)
    y = torch.nn.functional.linear(v, w8.to(torch.float32))
    got = epilogue_vllm_cpu_fp8(y, s, w_scale, bias, torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(got, epilogue_vllm_cpu_fp8(y, s, w_scale, None, torch.bfloat16))


def test_fp8_spec_is_checked():
    with pytest.raises(ValueError, match="dynamic per-token E4M3"):
        quant_values_vllm_cpu_fp8(torch.zeros(2, 4), QuantSpec(FormatName.E4M3, Granularity.TENSOR,
                                                                dynamic=Dynamic.STATIC))


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    from helpers.models import tiny_llama

    for scheme in ("w8a8-fp8-dynamic", "w8a8-fp8"):
        d = tmp_path_factory.mktemp(scheme)
        q = lowbit.quantize(tiny_llama(), scheme, calib, num_samples=4, seq_len=32)
        lowbit.save(q, d, format="compressed-tensors", tokenizer=byte_tokenizer(), overwrite=True)
        out[scheme] = d
    return out


def test_load_fp8_dynamic_with_vllm_numerics(fp8_folders, token_ids):
    emu = lowbit.load(fp8_folders["w8a8-fp8-dynamic"], numerics=ServingNumerics.VLLM_CPU)
    ref = lowbit.load(fp8_folders["w8a8-fp8-dynamic"])
    layers = [m for m in emu.modules() if isinstance(m, lowbit.modules.QuantLinear)]
    assert {m.backend.name for m in layers} == {"vllm-cpu-fp8"} and next(emu.parameters()).dtype == torch.bfloat16
    # one layer against the kernel written out from vLLM's source, on a bf16 input
    m = layers[0]
    x = (torch.randn(5, 7, m.in_features, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    a8, a_s = vllm_quant_fp8(x.reshape(-1, m.in_features))
    w8 = E4M3.decode(m.weight_codes).to(torch.float8_e4m3fn)
    want = vllm_channelwise(a8, a_s, w8, m.weight_scale.float().reshape(-1), m.bias, torch.bfloat16)
    assert torch.equal(m(x).reshape(-1, m.out_features), want)
    with torch.no_grad():
        a = torch.log_softmax(emu(input_ids=token_ids).logits.float(), -1)
        b = torch.log_softmax(ref(input_ids=token_ids).logits.float(), -1)
    assert 1e-4 < (a - b).abs().max().item() < 0.2  # bf16: close to, not equal to, the float32 meaning


def test_fp8_static_has_no_vllm_cpu_emulation(fp8_folders):
    with pytest.raises(LowbitError, match=r"numerics 'vllm-cpu': no emulation .* \(scheme w8a8-fp8\)"):
        lowbit.load(fp8_folders["w8a8-fp8"], numerics=ServingNumerics.VLLM_CPU)


def test_fp8_gemm_pads_the_tokens_as_vllm_does(tmp_path):
    """vLLM pads the tokens to >= 17 rows before torch._scaled_mm (get_output_padding), whose sums
    depend on the row count: a decoded row must give what it gives among 17 rows, not alone."""
    from helpers.models import tiny_llama
    from lowbit.backends.vllm_cpu import FP8_TOKEN_PADDING

    q = lowbit.quantize(tiny_llama(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                   num_key_value_heads=3, num_hidden_layers=1), "w8a8-fp8-dynamic")
    lowbit.save(q, tmp_path / "q", format="compressed-tensors")
    m = [x for x in lowbit.load(tmp_path / "q", numerics=ServingNumerics.VLLM_CPU).modules()
         if isinstance(x, lowbit.modules.QuantLinear)][-1]                  # down_proj: 1536 inputs
    x = torch.randn(FP8_TOKEN_PADDING, m.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(m(x[:1]), m(x)[:1])
    # (why the padding matters: on some hosts, e.g. the AMD EPYC ones of 2026-12, torch._scaled_mm
    # sums one row alone otherwise than among 17; not asserted: it is the host's GEMM, not lowbit)
