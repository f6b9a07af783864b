"""Padded calibration windows: padding never counts in observers, SmoothQuant statistics, GPTQ
Hessians or reconstruction losses (the result does not depend on what the padding holds)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from helpers.models import tiny_llama
from lowbit.calibration import CalibrationConfig, LayerwiseCalibrator, calibration_set
from lowbit.calibration.observers import make_observer
from lowbit.calibration.stats import GroupStats
from lowbit.schemes import get_scheme
from lowbit.targets import quantizable_linears

PAD_A, PAD_B = 0, 2  # the byte tokenizer's eos, and byte 2 (never in the text)


def tokenizer(pad_id: int):
    tok = byte_tokenizer()
    tok.pad_token = tok.convert_ids_to_tokens(pad_id)
    assert tok.pad_token_id == pad_id
    return tok


def loud_pads(model):
    """Padding embeddings far above the text's, unlike each other: counted, they would set the
    static scales (the norm keeps a one-channel embedding's spike)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[PAD_A] = 0.0
        emb[PAD_A, 3] = 50.0  # all in an outlier channel: after the norm, sqrt(64) x its weight (12)
        emb[PAD_B] = -90 * torch.randn(emb.shape[1], generator=g)
    return model


@pytest.fixture
def texts(tmp_path):
    f = tmp_path / "t.jsonl"
    lines = ["The quick brown fox jumps over the lazy dog. " * 2, "Pack my box.", "Sphinx of black quartz, judge",
             "A short one", "How vexingly quick daft zebras jump!"]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    return f


def test_masked_statistics_are_the_statistics_of_the_valid_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x[~valid] = 1000.0
    spec = get_scheme("w8a8-int8").input_activations
    masked = GroupStats(make_observer("mse", spec, max_rows=64), 64, hessian=True)
    masked.observe(x, 1, 5, valid)
    rows = [x[0, 1:3], x[1, 1:]]  # valid and after the first (sink) position
    plain = GroupStats(make_observer("mse", spec, max_rows=64), 64, hessian=True)
    plain.observe(torch.cat([x[0, :3], x[1]]), 0)  # every valid position: SmoothQuant statistics, Hessian
    assert torch.equal(masked.all_pos.amax(), plain.all_pos.amax())
    assert torch.allclose(masked.hessian, plain.hessian, rtol=1e-6, atol=1e-4)
    assert torch.equal(masked.scale_chan.amax(), torch.cat(rows).abs().amax(0))
    assert float(masked.scale_amax()) < 10  # the 1000s never reached the scale
    assert float(masked.all_pos.amax().amax()) < 10


@pytest.mark.parametrize("scheme, options", [
    ("w8a8-int8", {}),                                                     # static scales, SmoothQuant 0.8
    ("w4a16", {"reconstruct_iters": 3}),                                   # GPTQ Hessians + reconstruction
    ("nvfp4", {"reconstruct_iters": 2, "observer": "mse", "sink_positions": 1}),
])
def test_padding_content_changes_nothing(texts, scheme, options):
    base = loud_pads(tiny_llama())
    out = {}
    for pad in (PAD_A, PAD_B):
        q = lowbit.quantize(copy.deepcopy(base), scheme, calibration=str(texts), tokenizer=tokenizer(pad),
                            num_samples=5, seq_len=64, batch_size=2, pack=False, **options)
        out[pad] = q.state_dict()
        data = q.lowbit_calibration.data
        assert data["packing"] == "padded" and data["samples"] == 5
        lengths = [len(json.loads(line)["text"]) for line in texts.read_text().splitlines()]
        assert data["tokens"] == sum(min(n, 64) for n in lengths) and data["seq_len"] == 64
    assert out[PAD_A].keys() == out[PAD_B].keys()
    for k in out[PAD_A]:
        assert torch.equal(out[PAD_A][k], out[PAD_B][k]), k


def test_the_same_windows_unmasked_depend_on_the_padding(texts):
    """The control: counted, the padding moves the static scales (the test above could fail)."""
    base = loud_pads(tiny_llama())
    scales = {}
    for pad in (PAD_A, PAD_B):
        cs = calibration_set(texts, tokenizer(pad), num_samples=5, seq_len=64, pack=False)
        model = copy.deepcopy(base)
        names = quantizable_linears(model, [], False)
        cfg = CalibrationConfig(num_samples=5, seq_len=64, batch_size=2)
        rep = LayerwiseCalibrator(model, get_scheme("w8a8-int8"), cfg, None).run(cs.ids, names)  # no mask
        scales[pad] = [g.amax_used for g in rep.groups.values()]
    assert scales[PAD_A] != scales[PAD_B]


def test_kv_cache_needs_packed_windows(texts):
    from lowbit.errors import QuantizationError

    with pytest.raises(QuantizationError, match=r"kv_cache='fp8' calibrates on packed windows only.*pack=True"):
        lowbit.quantize(tiny_llama(), "w8a8-int8-dynamic", calibration=str(texts), tokenizer=tokenizer(PAD_A),
                        num_samples=5, seq_len=64, pack=False, kv_cache="fp8")
