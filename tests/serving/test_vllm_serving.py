"""Served as written (issue 21): vLLM's CPU build serves lowbit's w8a8-int8 folders (dynamic and
static) and w8a8-fp8-dynamic folders with the numbers lowbit's serving emulation of the host's
kernels (ServingNumerics.VLLM_CPU on AVX2, VLLM_CPU_AVX512 on AVX-512 + VNNI) predicts.

A tiny random Llama and a tiny random Qwen3 (per-head q/k RMSNorm before RoPE) (2 layers, hidden
256, head 64: vLLM's CPU attention needs a head size it has kernels for), quantized, saved as
compressed-tensors, served by vLLM in its own venv (lowbit.engines.run_vllm; skipped when there
is none). Compared, on the same token ids:
prompt log-probabilities and greedy continuations of vLLM, of lowbit's emulation and of lowbit's
own float32 evaluation of the folder. The emulation reproduces vLLM's linears and the ops around
them (RMSNorm with the residual add, RoPE, attention, SiLU·mul) bit for bit (bench/serve/RESULTS-serve.md),
so its log-probabilities differ from vLLM's only by the final float32 log-softmax (measured on
SmolLM2: 4e-5) and its greedy continuations are vLLM's.
"""

from __future__ import annotations

import pytest

import lowbit
from helpers.served import MODELS, calibration_ids, greedy, logprobs, max_abs_diff, perplexity, prompts
from lowbit.engines import EngineUnavailable, find_vllm_python, run_vllm
from lowbit.hostcpu import cpu_flags
from lowbit.quant.serving import ServingNumerics, host_isa


def _vllm_python():
    try:
        return find_vllm_python()
    except EngineUnavailable:
        return None


pytestmark = [pytest.mark.slow, pytest.mark.subprocess,
              pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm (../shared/README.md)")]


HOST_NUMERICS = ServingNumerics.for_host(host_isa(cpu_flags()))  # this host's vLLM-CPU kernels, if lowbit has them
bit_exact_host = pytest.mark.skipif(HOST_NUMERICS is None, reason="no lowbit emulation of this host's vLLM-CPU "
                                                                  "kernels (AMX, AVX-VNNI or AVX-512 without VNNI)")

# a mixed-precision folder (issue 36): three compressed-tensors groups of the schemes vLLM-CPU runs
RECIPES = {"mixed": {r"re:.*self_attn": "w8a8-int8", r"re:.*mlp\.down_proj": "w8a8-fp8-dynamic",
                     "default": "w8a8-int8-dynamic"}}
CASES = [(m, s) for m in MODELS for s in ("w8a8-int8-dynamic", "w8a8-int8", "w8a8-fp8-dynamic", "mixed")]
N_GEN = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{(model, scheme): (vLLM reply, emulation log-probs, lowbit float32 log-probs, emulation greedy)}."""
    ps = prompts()
    calib = calibration_ids()
    out = {}
    for name, scheme in CASES:
        d = tmp_path_factory.mktemp(f"{name}-{scheme}")
        q = lowbit.quantize(MODELS[name](), RECIPES.get(scheme, scheme), calib, num_samples=8, seq_len=64)
        lowbit.save(q, d, format="compressed-tensors", overwrite=True)
        reply = run_vllm(d, score=ps, generate=[p[:32] for p in ps], max_tokens=N_GEN)
        emu = lowbit.load(d, numerics=HOST_NUMERICS or ServingNumerics.VLLM_CPU)
        ref = lowbit.load(d)
        out[name, scheme] = (reply, logprobs(emu, ps), logprobs(ref, ps), greedy(emu, [p[:32] for p in ps], N_GEN))
    return out


@bit_exact_host
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_vllm_matches_the_serving_emulation(served, case):
    reply, emu, ref, _ = served[case]
    d_emu = max_abs_diff(reply.logprobs, emu)
    ppl_v, ppl_e = perplexity(reply.logprobs), perplexity(emu)
    print(f"{case}: ppl vLLM {ppl_v:.4f} emulation {ppl_e:.4f} lowbit {perplexity(ref):.4f}; max |dlogp| {d_emu:.3g}")
    assert d_emu < 1e-3
    assert abs(ppl_v / ppl_e - 1) < 1e-4


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_vllm_is_within_bf16_of_lowbit(served, case):
    reply, _, ref, _ = served[case]
    d_ref = max_abs_diff(reply.logprobs, ref)
    assert d_ref < 0.25
    assert abs(perplexity(reply.logprobs) / perplexity(ref) - 1) < 1e-2


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_the_emulation_is_within_bf16_of_vllm_on_any_host(served, case):
    """Within the bf16 bounds lowbit's own float32 evaluation meets, also on hosts without an
    emulation of their own (the AVX2 emulation on an AVX-512 + VNNI EPYC, 2026-12-02: max |dlogp|
    0.028-0.110, ppl 0.002-0.15% apart; each host's own emulation: bit for bit, the tests above)."""
    reply, emu, _, _ = served[case]
    d_emu = max_abs_diff(reply.logprobs, emu)
    assert d_emu < 0.25
    assert abs(perplexity(reply.logprobs) / perplexity(emu) - 1) < 1e-2


@bit_exact_host
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_generations_agree(served, case):
    reply, _, _, greedy = served[case]
    assert [list(v) for v in reply.generated] == [list(e) for e in greedy]
