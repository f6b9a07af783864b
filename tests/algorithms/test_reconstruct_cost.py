"""Reconstruction's fast paths give the codes of its plain expression, bit for bit, and the
calibration report counts the layer passes each phase makes (the cost model; never wall time)."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from lowbit.calibration.config import DEFAULT_RECONSTRUCT_ITERS
from helpers.models import tiny_llama
from lowbit.kernels import Implementation, using

TOKENS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))  # 2 batches of 4
SCHEMES = ["nvfp4", "nvfp4-e5m3", "mxfp4", "w4a16", "w4a8-int8", "w4a8-fp8"]


def _buffers(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if "layers." in n}


def _assert_same(a, b) -> None:
    ba, bb = _buffers(a), _buffers(b)
    assert ba.keys() == bb.keys()
    for n in ba:
        assert torch.equal(ba[n], bb[n]), n


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fast_paths_give_the_reference_codes(scheme):
    """The fused straight-through weight, the shared input QDQ and the native element codes
    against the reference implementation of every kernel (the plain autograd expression)."""
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    kw = {"calibration": TOKENS, "reconstruct_iters": 10, "weight_rounding": "gptq"}
    fast = lowbit.quantize(copy.deepcopy(ref), scheme, **kw)
    with using(Implementation.REFERENCE):
        slow = lowbit.quantize(copy.deepcopy(ref), scheme, **kw)
    assert sum(r["changed"] for r in fast.lowbit_calibration.reconstruct.values()) > 0
    _assert_same(fast, slow)


@pytest.mark.parametrize("scheme", ["nvfp4", "w4a8-int8"])
def test_reused_outputs_are_the_layers_own(scheme, monkeypatch):
    """The next layer's inputs taken from reconstruction's best evaluation give the model that
    running the quantized layer again gives."""
    from lowbit.calibration import pipeline

    ref = tiny_llama(hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    reused = lowbit.quantize(copy.deepcopy(ref), scheme, calibration=TOKENS, reconstruct_iters=10)
    assert reused.lowbit_calibration.cost.reused_outputs == 2  # every layer but the last
    monkeypatch.setattr(pipeline, "_runs_as_reference", lambda layer: False)
    rerun = lowbit.quantize(copy.deepcopy(ref), scheme, calibration=TOKENS, reconstruct_iters=10)
    cost = rerun.lowbit_calibration.cost
    assert cost.reused_outputs == 0 and cost.layer_calls["next-inputs"] == 2 * 2
    _assert_same(reused, rerun)


def test_reconstruction_default_cost_counts():
    """nvfp4's default with calibration data (GPTQ + the default steps, the last step evaluated on
    the whole set and checked against the given codes on step 0's windows) on 2 layers and 2
    batches: one observe pass and one target pass per layer, the steps and 1 whole-set evaluation
    per layer (the last step is better on step 0's windows in both), no separate pass for the next
    layer's inputs."""
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    q = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS)
    cost = q.lowbit_calibration.cost
    layers, batches = 2, 2
    steps = DEFAULT_RECONSTRUCT_ITERS
    assert cost.layer_calls == {"observe": layers * batches, "targets": layers * batches,
                                "reconstruct-steps": layers * steps, "reconstruct-evals": layers * batches}
    assert cost.backward_calls == layers * steps  # a step takes one window (reconstruct_batch_size's default)
    report = q.lowbit_calibration.reconstruct
    assert all(r["mse_start"] is None and r["check_end"] < r["check_start"] for r in report.values()), report
    assert cost.reused_outputs == layers - 1
    assert {"capture", "observe", "targets", "quantize", "reconstruct-steps", "reconstruct-evals"} <= set(cost.seconds)
    d = cost.as_dict()
    assert d["layer_calls"] == cost.layer_calls and all(v >= 0 for v in d["seconds"].values())


def test_rtn_static_cost_counts():
    """w8a8-int8 (RTN weights, float layer inputs): the observe pass alone, whose outputs are the
    next layer's inputs; nothing else runs the layers."""
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    q = lowbit.quantize(copy.deepcopy(ref), "w8a8-int8", calibration=TOKENS)
    cost = q.lowbit_calibration.cost
    assert cost.layer_calls == {"observe": 2 * 2}
    assert cost.backward_calls == 0 and cost.reused_outputs == 0


def test_slice_call_cuts_the_window_dimension_only():
    from lowbit.calls import slice_call

    h = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    cos = torch.ones(1, 3, 8)              # a shared RoPE table
    mask = torch.zeros(4, 1, 3, 3)         # per window
    cache = torch.arange(4)                # 1-D cache positions: kept even when their length is the batch
    args, kw = slice_call(((h,), {"position_embeddings": (cos, cos), "attention_mask": mask,
                                  "cache_position": cache, "use_cache": False}), 4, 1, 3)
    assert torch.equal(args[0], h[1:3]) and kw["attention_mask"].shape[0] == 2
    assert kw["position_embeddings"][0] is cos and kw["cache_position"] is cache and kw["use_cache"] is False


@pytest.mark.parametrize("size, steps", [(None, 2), (1, 8), (3, 4)])
def test_steps_take_windows_strided_one_at_a_time(size, steps, monkeypatch):
    """Each step takes ``reconstruct_batch_size`` windows (None: a batch's 4) strided over the 8
    (2 batches of 4), every window run alone: the windows each step's layer calls see."""
    from lowbit.algorithms import reconstruct

    seen = []
    real = reconstruct._run

    def spy(layer, calls, device):
        if torch.is_grad_enabled():
            h = calls[0][0][0] if calls[0][0] else calls[0][1]["hidden_states"]
            seen.append((len(calls), int(h.shape[0])))
        return real(layer, calls, device)

    monkeypatch.setattr(reconstruct, "_run", spy)
    calls_in = []
    real_take = reconstruct.StepPlan.atoms

    def atoms(plan, s):
        got = real_take(plan, s)
        calls_in.append([a.batch * 4 + a.rows.start for a in got])
        return got

    monkeypatch.setattr(reconstruct.StepPlan, "atoms", atoms)
    ref = tiny_llama(hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=steps,
                    reconstruct_batch_size=size)
    expect = {None: [[0, 2, 4, 6], [1, 3, 5, 7]], 1: [[w] for w in range(8)],
              3: [[0, 3, 6], [1, 4, 7], [2, 5], [0, 3, 6]]}[size]
    assert calls_in == expect
    assert seen == [(1, 1)] * sum(map(len, expect))  # one window per call


def test_reconstruct_batch_size_is_checked_and_the_cli_takes_it():
    from lowbit.calibration import CalibrationConfig, CalibrationError
    from lowbit.cli.common import OptionError, reconstruct_batch_size_option

    assert CalibrationConfig().reconstruct_batch_size == 1
    assert CalibrationConfig.preset("best").reconstruct_batch_size is None  # best: a whole batch a step
    with pytest.raises(CalibrationError, match="reconstruct_batch_size"):
        CalibrationConfig(reconstruct_batch_size=0)
    assert reconstruct_batch_size_option(None) == {}
    assert reconstruct_batch_size_option(0) == {"reconstruct_batch_size": None}
    assert reconstruct_batch_size_option(2) == {"reconstruct_batch_size": 2}
    with pytest.raises(OptionError, match="--reconstruct-batch-size"):
        reconstruct_batch_size_option(-1)


@pytest.mark.parametrize("every, evals", [(None, 1), (2, 4), (4, 3)])
def test_whole_set_evaluations_at_the_start_the_end_and_every_eval_every(every, evals, monkeypatch):
    """By default the whole calibration set is evaluated once, after the last step (the given codes
    are checked on step 0's windows; here the last step is better there in every layer); with
    ``eval_every`` the given codes are evaluated at the start and every that many steps (6 steps: 2
    -> steps 2, 4, 6; 4 -> 4, 6)."""
    import dataclasses

    from lowbit.calibration import CalibrationConfig

    real = CalibrationConfig.reconstruct_options
    monkeypatch.setattr(CalibrationConfig, "reconstruct_options",
                        lambda self, s: dataclasses.replace(real(self, s), eval_every=every))
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    q = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=6)
    for name, r in q.lowbit_calibration.reconstruct.items():
        assert len(r["history"]) == evals, (name, r)
        assert r["mse_end"] == min(r["history"])
        assert (r["mse_start"] is None) == (every is None), (name, r)
        assert (r["check_end"] < r["check_start"]) if every is None else r["check_start"] is None, (name, r)
    assert q.lowbit_calibration.cost.layer_calls["reconstruct-evals"] == 2 * evals * 2  # layers x evals x batches


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_eval_every_is_checked(bad):
    from lowbit.algorithms.reconstruct import ReconstructOptions

    with pytest.raises(ValueError, match="eval_every"):
        ReconstructOptions(eval_every=bad)


def test_a_failed_check_sends_the_decision_to_the_whole_set():
    """Steps far too large (lr 0.5: every offset jumps half a grid step at once) leave the layer worse
    on step 0's windows: the given codes are then evaluated on the whole set too, found better,
    and kept (step 0's offsets: their error is the whole-set start figure)."""
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    q = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=2, reconstruct_lr=0.5)
    report = q.lowbit_calibration.reconstruct
    r = report["model.layers.0"]
    assert r["check_end"] >= r["check_start"], r
    assert r["mse_start"] is not None and len(r["history"]) == 2 and r["history"][0] == r["mse_start"]
    assert r["best_step"] == 0 and r["mse_end"] == r["mse_start"] < r["history"][1]
    evals = sum(1 + (x["mse_start"] is not None) for x in report.values())
    assert q.lowbit_calibration.cost.layer_calls["reconstruct-evals"] == evals * 2  # x 2 batches
