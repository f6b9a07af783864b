"""Shared float hidden states (lowbit.calibration.FloatStates): a second calibrated run on the
same float model and windows takes the first one's float outputs instead of running every
decoder layer again, with the codes it gets alone; another key, a rotation or SmoothQuant
neither reads nor overwrites them; compare shares one across its rows."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from helpers.models import tiny_llama
from lowbit.calibration import FloatStates
from lowbit.report import CompareOptions, run_compare

TOKENS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
OTHER = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(2))
LAYERS = 3


def _model():
    return tiny_llama(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS)


def _same(a, b) -> None:
    bufs = dict(b.named_buffers())
    assert len(bufs) > 0
    for n, x in a.named_buffers():
        assert torch.equal(x, bufs[n]), n


def test_a_second_run_reuses_the_float_states_with_the_codes_it_gets_alone():
    ref = _model()
    fs = FloatStates()
    first = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, float_states=fs)
    shared = lowbit.quantize(copy.deepcopy(ref), "nvfp4-e5m3", calibration=TOKENS, float_states=fs)
    alone = lowbit.quantize(copy.deepcopy(ref), "nvfp4-e5m3", calibration=TOKENS)
    _same(shared, alone)
    c1, c2, c3 = (m.lowbit_calibration.cost for m in (first, shared, alone))
    batches = 2  # 8 windows, batch_size 4
    assert c1.layer_calls["targets"] == c3.layer_calls["targets"] == LAYERS * batches
    assert c1.reused_float_states == 0 and c3.reused_float_states == 0
    assert "targets" not in c2.layer_calls and c2.reused_float_states == LAYERS
    assert sorted(fs.states) == list(range(LAYERS))


def test_another_key_neither_reads_nor_overwrites():
    ref = _model()
    fs = FloatStates()
    lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, float_states=fs)
    kept = {i: [t.clone() for t in v] for i, v in fs.states.items()}
    other = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=OTHER, float_states=fs)
    assert other.lowbit_calibration.cost.reused_float_states == 0
    _same(other, lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=OTHER))
    bigger = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, float_states=fs, batch_size=2)
    assert bigger.lowbit_calibration.cost.reused_float_states == 0
    assert all(torch.equal(a, b) for i in kept for a, b in zip(kept[i], fs.states[i]))


@pytest.mark.parametrize("options", [{"smoothquant": 0.5}, {"rotation": "hadamard"}])
def test_smoothquant_or_a_rotation_does_not_use_them(options):
    ref = _model()
    fs = FloatStates()
    lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, float_states=fs)
    q = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, float_states=fs, **options)
    assert q.lowbit_calibration.cost.reused_float_states == 0
    _same(q, lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, **options))


def test_compare_rows_share_the_float_states(tmp_path):
    text = tmp_path / "eval.txt"
    para = "one two three four five six seven eight nine ten eleven twelve and then the end came at last"
    text.write_text("\n".join(f"{para} {w}." for w in ("apple", "river", "stone", "cloud")))
    opts = CompareOptions(schemes=["nvfp4", "nvfp4-e5m3"], limit=64, window=32, lastword=0, text_file=str(text),
                          calib=str(text), calib_samples=4, calib_seq_len=32, sqnr_tokens=16, progress=False)
    report = run_compare(_model(), byte_tokenizer(), opts=opts)
    first, second = (r["calibration_cost"] for r in report["schemes"])
    assert first["reused_float_states"] == 0 and first["layer_calls"]["targets"] == LAYERS
    assert second["reused_float_states"] == LAYERS and "targets" not in second["layer_calls"]


def test_something_else_than_float_states_is_one_error_before_any_work():
    from lowbit.errors import QuantizationError

    model = _model()
    with pytest.raises(QuantizationError, match="float_states must be a lowbit.calibration.FloatStates or None, got dict"):
        lowbit.quantize(model, "nvfp4", calibration=TOKENS, float_states={})
    assert not any(hasattr(m, "scheme") for m in model.modules())  # nothing quantized
