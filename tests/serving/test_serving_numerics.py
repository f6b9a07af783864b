"""ServingNumerics.VLLM_CPU: vLLM-CPU's int8 rounding and scale order as lowbit functions, the
backend that runs them, ``lowbit.load(numerics=...)``, ``lowbit eval --numerics/--engine`` and the
engine-scored evaluation (same report as lowbit's own, from another scorer)."""

from __future__ import annotations

import math

import pytest
import torch

import lowbit
from helpers.cli import assert_one_error, run
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder
from lowbit.errors import LowbitError
from lowbit.eval import lastword_accuracy, perplexity, score_positions
from lowbit.eval.engine import engine_report
from lowbit.numerics import FormatName
from lowbit.quant import int_values
from lowbit.quant.serving import (Accumulation, CpuIsa, ServingNumerics, accumulation, bf16_truncate,
                                  epilogue_vllm_cpu, pair_saturation, quant_codes_vllm_cpu, saturating_pairs, to_bf16)
from lowbit.schemes import Dynamic, Granularity, QuantSpec

STATIC = QuantSpec(FormatName.INT8, Granularity.TENSOR, dynamic=Dynamic.STATIC)
DYNAMIC = QuantSpec(FormatName.INT8, Granularity.TOKEN, dynamic=Dynamic.DYNAMIC)


def test_vllm_multiplies_by_the_rounded_reciprocal():
    # 2.25 / 0.3 = 7.4999995 in float32 (rounds to 7); 2.25 * float32(1/0.3) = 7.5 (rounds to even, 8)
    x = torch.tensor([[2.25, -2.25, 8.25, 100.0, -100.0]], dtype=torch.bfloat16)
    s = torch.tensor([0.3])
    q, qs = quant_codes_vllm_cpu(x, STATIC, s)
    lq, _ = int_values(x.float(), STATIC, s)
    assert q.tolist() == [[8.0, -8.0, 28.0, 127.0, -128.0]]
    assert lq.tolist() == [[7.0, -7.0, 27.0, 127.0, -128.0]]
    assert qs.tolist() == [pytest.approx(0.3)]


def test_vllm_per_token_scale_is_lowbits_and_codes_differ_only_at_ties():
    x = (torch.randn(256, 576, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    q, s = quant_codes_vllm_cpu(x, DYNAMIC)
    lq, ls = int_values(x.float(), DYNAMIC, None)
    assert torch.equal(s, ls)  # amax / 127 in float32, both
    diff = q != lq
    assert int(diff.sum()) == 56  # of 147456 (seeded)
    assert bool(((q - lq).abs()[diff] == 1).all())
    frac = (x.float() / s)[diff].abs() % 1
    assert bool(((frac - 0.5).abs() < 1e-5).all())  # only x / s within an ulp of a half


def test_a_zero_row_gives_zero_codes():
    q, s = quant_codes_vllm_cpu(torch.zeros(2, 8, dtype=torch.bfloat16), DYNAMIC)
    assert q.abs().sum() == 0 and s.abs().sum() == 0


def test_epilogue_scale_orders():
    acc = torch.tensor([[12345, -777]], dtype=torch.int32)
    sx, sw = torch.tensor([0.0123]), torch.tensor([0.0031, 0.7])
    b = torch.tensor([0.5, -0.25], dtype=torch.bfloat16)
    y = epilogue_vllm_cpu(acc, sx, sw, b, torch.float32, dynamic=False)
    # static: the input scale first, then the weight scale (oneDNN; 0 of 13.3M captured outputs off)
    assert torch.equal(y, (acc.float() * sx) * sw + b.float())
    assert not torch.equal(y, acc.float() * (sx * sw) + b.float())   # these values tell the orders apart
    y = epilogue_vllm_cpu(acc, sx.reshape(1, 1), sw, b, torch.bfloat16, dynamic=True)
    y32 = (acc.float() * sw) * sx + b.float()
    assert torch.equal(y, bf16_truncate(y32)) and y.tolist() == [[0.96875, -6.9375]]


def test_bf16_truncation_rounds_toward_zero():
    x = torch.tensor([1.0 + 2 ** -8 + 2 ** -10, -(1.0 + 2 ** -8 + 2 ** -10), 3.0, float("inf")])
    assert bf16_truncate(x).tolist() == [1.0, -1.0, 3.0, float("inf")]
    assert x.to(torch.bfloat16).tolist()[:2] == [1.0078125, -1.0078125]


def test_vpmaddubsw_pair_saturation():
    # u = q + 128; a pair's u*w sum saturates to int16; the compensation 128 * sum(w) is exact
    w = torch.tensor([[127, 127], [-127, -127], [127, -127], [20, 30]], dtype=torch.int8)
    q = torch.tensor([[127.0, 127.0], [-128.0, -128.0]])
    pairs = saturating_pairs(w)
    assert pairs[0].tolist() == [0, 1]  # the mixed-sign and the small pair can never saturate
    exact = q @ w.float().t()
    got = exact.to(torch.int32) + pair_saturation(q, pairs, 4)
    assert exact.tolist()[0] == [32258.0, -32258.0, 0.0, 6350.0]
    assert got.tolist() == [[255, -256, 0, 6350], [-32512, 32512, 0, -6400]]
    assert accumulation(True, torch.bfloat16) is Accumulation.PAIRS_INT16
    assert accumulation(False, torch.bfloat16) is Accumulation.EXACT


def test_an_avx512_vnni_host_sums_exactly_and_rounds_bf16_to_nearest():
    """ServingNumerics.VLLM_CPU_AVX512: vLLM-CPU on AVX-512 + VNNI (bit for bit against vLLM on such a
    host: bench/serve/RESULTS-serve.md): exact int8 sums on every path, bf16 stores rounded to nearest."""
    from lowbit.quant.serving_ops import lane_sum, rope

    avx2, avx512 = CpuIsa.AVX2, CpuIsa.AVX512_VNNI
    assert ServingNumerics.VLLM_CPU.isa is avx2 and ServingNumerics.VLLM_CPU_AVX512.isa is avx512
    assert ServingNumerics.LOWBIT.isa is None and ServingNumerics.VLLM_CPU_AVX512.model_dtype == torch.bfloat16
    assert accumulation(True, torch.bfloat16, avx512) is Accumulation.EXACT
    assert accumulation(False, torch.float32, avx512) is Accumulation.EXACT
    x = torch.tensor([1.0 + 2 ** -8 + 2 ** -10, -(1.0 + 2 ** -8 + 2 ** -10)])
    assert to_bf16(x, avx512).tolist() == [1.0078125, -1.0078125] and to_bf16(x, avx2).tolist() == [1.0, -1.0]
    acc, sx, sw = torch.tensor([[12345, -777]]), torch.tensor([[0.0123]]), torch.tensor([0.0031, 0.7])
    y32 = (acc.float() * sw) * sx
    assert torch.equal(epilogue_vllm_cpu(acc, sx, sw, None, torch.bfloat16, dynamic=True, isa=avx512),
                       y32.to(torch.bfloat16))
    # 16 lanes whose sum depends on the order: AVX2 adds each 8-lane half in order, then the halves
    lanes = torch.tensor([1e8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1e8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert float(lane_sum(lanes)) == 0.0       # each 1 added to +-1e8 alone is lost (its ulp is 8)
    # RoPE of [1, -1.5 * 2^-7] at cos = sin = 1: 1 + 1.5 * 2^-7, a tie between two bf16 values
    q = torch.tensor([[[1.0, -1.5 * 2 ** -7]]], dtype=torch.bfloat16)
    one = torch.ones(1, 2)
    assert rope(q, one, one, avx2)[0, 0, 0].item() == 1.0078125 and rope(q, one, one, avx512)[0, 0, 0].item() == 1.015625


def test_the_host_kind_from_its_cpu_flags(tmp_path):
    from lowbit.hostcpu import cpu_flags
    from lowbit.quant.serving import host_isa

    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert host_isa(avx2) is CpuIsa.AVX2
    assert host_isa(avx2 | {"avx512f", "avx512_vnni"}) is CpuIsa.AVX512_VNNI
    assert host_isa(avx2 | {"avx512f"}) is None                      # AVX-512 without VNNI: not captured
    assert host_isa(avx2 | {"avx_vnni"}) is None
    assert host_isa(avx2 | {"avx512f", "avx512_vnni", "amx_tile"}) is None
    assert host_isa(frozenset()) is None
    assert ServingNumerics.for_host(CpuIsa.AVX2) is ServingNumerics.VLLM_CPU
    assert ServingNumerics.for_host(CpuIsa.AVX512_VNNI) is ServingNumerics.VLLM_CPU_AVX512
    assert ServingNumerics.for_host(None) is None
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(f)) == {"fpu", "avx2", "avx512f", "avx512_vnni"}
    assert cpu_flags(str(tmp_path / "none")) == frozenset()


@pytest.fixture(scope="module")
def int8_folders(tmp_path_factory):
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    from helpers.models import tiny_llama

    for scheme in ("w8a8-int8", "w8a8-int8-dynamic", "w8a16"):
        d = tmp_path_factory.mktemp(scheme)
        # head size 32: the engine layers reproduce vLLM-CPU around the linears too (lowbit.modules.engine_layers)
        q = lowbit.quantize(tiny_llama(num_attention_heads=2), scheme, calib, num_samples=4, seq_len=32)
        lowbit.save(q, d, format="compressed-tensors", tokenizer=byte_tokenizer(), overwrite=True)
        out[scheme] = d
    return out


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-int8-dynamic"])
def test_load_with_vllm_numerics(int8_folders, scheme, token_ids):
    emu = lowbit.load(int8_folders[scheme], numerics=ServingNumerics.VLLM_CPU)
    ref = lowbit.load(int8_folders[scheme])
    names = {m.backend.name for m in emu.modules() if isinstance(m, lowbit.modules.QuantLinear)}
    assert names == {"vllm-cpu-int8"} and next(emu.parameters()).dtype == torch.bfloat16
    emu512 = lowbit.load(int8_folders[scheme], numerics=ServingNumerics.VLLM_CPU_AVX512)
    assert {m.backend.name for m in emu512.modules() if isinstance(m, lowbit.modules.QuantLinear)} == \
        {"vllm-cpu-avx512-int8"}
    with torch.no_grad():
        a = torch.log_softmax(emu(input_ids=token_ids).logits.float(), -1)
        b = torch.log_softmax(ref(input_ids=token_ids).logits.float(), -1)
    d = (a - b).abs().max().item()
    assert 1e-4 < d < 0.2  # bf16 and vLLM's rounding: close to, not equal to, the float32 meaning


def test_numerics_of_another_kind_of_host_are_kept_and_said(int8_folders, monkeypatch):
    import sys
    import warnings

    load_mod = sys.modules["lowbit.checkpoint.load"]   # the package's `load` attribute is the function

    monkeypatch.setattr(load_mod, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    with pytest.warns(UserWarning, match=r"'vllm-cpu' are vLLM-CPU's on AVX2 hosts; this host is AVX512, where "
                                         r"vLLM computes 'vllm-cpu-avx512'"):
        m = lowbit.load(int8_folders["w8a8-int8-dynamic"], numerics=ServingNumerics.VLLM_CPU)
    assert {x.backend.name for x in m.modules() if isinstance(x, lowbit.modules.QuantLinear)} == {"vllm-cpu-int8"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowbit.load(int8_folders["w8a8-int8-dynamic"], numerics=ServingNumerics.VLLM_CPU_AVX512)
        monkeypatch.setattr(load_mod, "cpu_flags", lambda: frozenset())   # an unknown host: nothing to say
        lowbit.load(int8_folders["w8a8-int8-dynamic"], numerics=ServingNumerics.VLLM_CPU)


def test_numerics_refuses_what_it_does_not_emulate(int8_folders):
    with pytest.raises(LowbitError, match=r"numerics 'vllm-cpu': no emulation .* layer 'model.layers.0.self_attn.q_proj' \(scheme w8a16\)"):
        lowbit.load(int8_folders["w8a16"], numerics=ServingNumerics.VLLM_CPU)
    with pytest.raises(LowbitError, match=r"backend 'reference' cannot be combined"):
        lowbit.load(int8_folders["w8a8-int8"], backend="reference", numerics=ServingNumerics.VLLM_CPU)
    with pytest.raises(LowbitError, match=r"numerics must be a ServingNumerics"):
        lowbit.load(int8_folders["w8a8-int8"], numerics="vllm-cpu")


def test_cli_numerics_and_engine_errors(capsys, int8_folders):
    code, _, err = run(capsys, "eval", int8_folders["w8a8-int8"], "--numerics", "sglang", "--no-progress")
    assert_one_error(code, err, "--numerics", "lowbit, vllm-cpu", "sglang")
    code, _, err = run(capsys, "eval", int8_folders["w8a8-int8"], "--engine", "vllm", "--vllm-python",
                       "/nonexistent/python", "--no-progress")
    assert_one_error(code, err, "--vllm-python", "/nonexistent/python", "no such file")
    code, _, err = run(capsys, "eval", int8_folders["w8a8-int8"], "--engine", "vllm", "--numerics", "vllm-cpu")
    assert_one_error(code, err, "--engine vllm", "--numerics")


def test_cli_eval_with_vllm_numerics(capsys, int8_folders):
    import json

    ppl = {}
    for numerics in ("vllm-cpu", "vllm-cpu-avx512"):
        code, out, err = run(capsys, "eval", int8_folders["w8a8-int8-dynamic"], "--numerics", numerics, "--limit",
                             "64", "--window", "32", "--lastword", "4", "--spread", "0", "--json", "--no-progress")
        assert code == 0, err
        rep = json.loads(out)["model"]
        assert rep["numerics"] == numerics and rep["tokens_scored"] == 64 and math.isfinite(rep["perplexity"])
        ppl[numerics] = rep["perplexity"]
    assert ppl["vllm-cpu"] != ppl["vllm-cpu-avx512"]   # the hosts' kernels round differently


def test_engine_report_is_lowbits_report_from_another_scorer(tmp_path):
    from lowbit.models import load_model

    model, tok = load_model(save_tiny_folder(tmp_path / "m"))

    def score(prompts):
        lps, greedy = [], []
        for ids in prompts:
            t = torch.arange(1, len(ids))
            lp, arg = score_positions(model, torch.tensor([ids]), torch.stack([torch.zeros_like(t), t], 1))
            lps.append(lp.tolist())
            greedy.append((arg == torch.tensor(ids[1:])).tolist())
        return lps, greedy

    ppl, lw = engine_report(score, tok, window=48, limit=150, lastword=6)
    want = perplexity(model, tok, window=48, limit=150, progress=False)
    want_lw = lastword_accuracy(model, tok, limit=6, progress=False)
    got, exp = ppl.to_dict(), want.to_dict()
    assert got.pop("perplexity") == pytest.approx(exp.pop("perplexity"), rel=1e-6)
    assert got.pop("nll") == pytest.approx(exp.pop("nll"), rel=1e-6)
    assert got.pop("bits_per_byte") == pytest.approx(exp.pop("bits_per_byte"), rel=1e-6)
    assert got == exp  # tokens, bytes, windows, window, stride, BOS: the same plan
    assert lw.correct == want_lw.correct and lw.examples == want_lw.examples == 6
    assert lw.mean_logprob == pytest.approx(want_lw.mean_logprob, rel=1e-5)
