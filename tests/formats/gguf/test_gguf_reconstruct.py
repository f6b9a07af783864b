"""Block reconstruction of a calibrated GGUF file (``lowbit.gguf_reconstruct``, ``reconstruct_iters``):
it lowers a decoder layer's output error, changes codes and never a scale, min or type, leaves
the tensors outside the layers as they were, is off by default, and runs on a folder only."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from helpers.cli import assert_one_error, leftovers, run
from helpers.gguf_folders import save_gguf_folder, skip_without_converter
from helpers.models import tiny_llama

skip_without_converter()

import lowbit  # noqa: E402
from lowbit.algorithms.reconstruct import ReconstructOptions, token_weights, weighted_se  # noqa: E402
from lowbit.calibration import CalibrationConfig  # noqa: E402
from lowbit.errors import QuantizationError  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.numerics.ggml import GgmlType, decode, encode  # noqa: E402
from lowbit.numerics.ggml_codes import AFFINE, codes_of, grid_of  # noqa: E402

SIZE = dict(vocab_size=300, hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_gguf_folder(tiny_llama(**SIZE), tmp_path_factory.mktemp("llama"))


def _ids(n: int = 4, t: int = 32) -> torch.Tensor:
    return torch.randint(3, 300, (n, t), generator=torch.Generator().manual_seed(5))


def _file(folder, out, iters):
    cfg = CalibrationConfig(num_samples=4, seq_len=32, batch_size=2,
                            **({} if iters is None else {"reconstruct_iters": iters}))
    report = quantize_gguf(folder, out, "q2_k", calibration=_ids(), config=cfg, progress=False)
    assert len(report.reconstructed) == (2 if iters else 0)  # both decoder layers, or none
    assert not iters or sum(r["changed"] for r in report.reconstructed.values()) > 0
    return report.path


def _tensors(path) -> dict[str, tuple[str, torch.Tensor]]:
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, torch.from_numpy(t.data.copy()).reshape(t.data.shape))
            for t in r.tensors}


def test_reconstruction_moves_codes_and_keeps_every_scale(folder, tmp_path):
    plain, tuned = _tensors(_file(folder, tmp_path / "a.gguf", 0)), _tensors(_file(folder, tmp_path / "b.gguf", 10))
    assert sorted(plain) == sorted(tuned)
    moved = 0
    for name, (kind, data) in plain.items():
        kind2, data2 = tuned[name]
        assert kind == kind2 and data.shape == data2.shape, name
        if not name.startswith("blk.") or kind.lower() not in {t.value for t in AFFINE}:
            assert torch.equal(data, data2), f"{name} is outside the reconstructed linears and changed"
            continue
        k = GgmlType(kind.lower())
        g1, g2 = grid_of(data.view(torch.uint8), k), grid_of(data2.view(torch.uint8), k)
        assert torch.equal(g1.step, g2.step) and torch.equal(g1.offset, g2.offset), name
        moved += int((codes_of(data.view(torch.uint8), k) != codes_of(data2.view(torch.uint8), k)).sum())
    assert moved > 0


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_off_by_default(folder, tmp_path):
    from lowbit.cli.common import RECONSTRUCT_ITERS_HELP
    from lowbit.gguf_options import DEFAULT_GGUF_RECONSTRUCT_ITERS

    assert DEFAULT_GGUF_RECONSTRUCT_ITERS == 0 and "--format gguf: 0" in RECONSTRUCT_ITERS_HELP
    assert _sha(_file(folder, tmp_path / "d.gguf", None)) == _sha(_file(folder, tmp_path / "z.gguf", 0))


def test_a_tuned_layer_has_a_lower_output_error_and_its_outputs_are_the_rows():
    from lowbit.calibration.capture import output_hidden
    from lowbit.calibration.layer_calls import capture_calls
    from lowbit.gguf_reconstruct import tune_layer

    model = tiny_llama(**SIZE)
    layers = model.model.layers
    with torch.no_grad():
        calls = capture_calls(model, layers, _ids(), 2).first
        layer = layers[0]
        targets = [output_hidden(layer(*a, **k)) for a, k in calls]
    prefix = "model.layers.0."
    floats = {f"{prefix}{n}.weight": m.weight.detach().clone() for n, m in layer.named_modules()
              if isinstance(m, torch.nn.Linear)}
    kind = GgmlType.Q2_K
    rows = {w: (kind, encode(W, kind, w)) for w, W in floats.items()}
    names = {w[:-len(".weight")]: [w] for w in floats}

    def error(r) -> float:
        with torch.no_grad():
            for w, (k, data) in r.items():
                layer.get_submodule(w[len(prefix):-len(".weight")]).weight.copy_(decode(data, k).reshape(floats[w].shape))
            outs = [output_hidden(layer(*a, **kw)) for a, kw in calls]
        return sum(float(weighted_se(o, t, token_weights(t)).sum()) for o, t in zip(outs, targets)), outs

    given, _ = error(rows)
    got, outs, rep = tune_layer(layer, prefix, rows, names, floats.__getitem__, calls, targets,
                                ReconstructOptions(iters=20))
    assert rep.changed > 0 and sorted(got) == sorted(rows)
    tuned, outs_again = error(got)
    assert tuned < given
    for a, b in zip(outs, outs_again):  # the outputs handed to the next layer are the file's rows'
        assert torch.equal(a, b)


def test_in_memory_writes_the_folders_file(folder, tmp_path):
    """``lowbit.quantize`` + ``lowbit.save`` with reconstruction: the streamed run's file, byte for byte."""
    model = lowbit.load_model(folder)[0]
    lowbit.quantize(model, "q2_k", _ids(), num_samples=4, seq_len=32, batch_size=2, reconstruct_iters=10)
    mem = lowbit.save(model, tmp_path / "mem.gguf", format="gguf")
    assert _sha(mem) == _sha(_file(folder, tmp_path / "f.gguf", 10))
    assert _sha(mem) != _sha(_file(folder, tmp_path / "z.gguf", 0))
    with pytest.raises(QuantizationError, match="'reconstruct_scales'"):
        lowbit.quantize(lowbit.load_model(folder)[0], "q2_k", _ids(), reconstruct_iters=5, reconstruct_scales=True)


def test_the_cli(folder, tmp_path, capsys):
    out = tmp_path / "c.gguf"
    code, stdout, err = run(capsys, "quantize", folder, "--format", "gguf", "--scheme", "q2_k", "--calib-samples",
                            "2", "--calib-seq-len", "32", "--reconstruct-iters", "3", "-o", out, "--json")
    assert code == 0 and out.is_file(), err
    rec = json.loads(stdout)["gguf"]["reconstructed"]  # the summary says what the reconstruction did
    assert sorted(rec) == ["model.layers.0", "model.layers.1"]
    assert all(r["weights"] > 0 and r["mse_end"] >= 0 for r in rec.values())
    code, _, err = run(capsys, "quantize", folder, "--format", "gguf", "--scheme", "q2_k", "--model-free",
                       "--reconstruct-iters", "3", "-o", tmp_path / "m.gguf")
    assert_one_error(code, err, "--model-free")
    assert leftovers(tmp_path / "m.gguf") == []


def _family_runs(family: str, tmp_path) -> None:
    from helpers.families import tiny_model

    from lowbit.formats import Format, get_format
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.errors import FormatError
    from lowbit.gguf_gptq import source_types
    from lowbit.gguf_streamed import Spill, streamed_sources
    from lowbit.numerics.ggml import ImportanceSearch

    try:
        model = tiny_model(family)
        model.save_pretrained(tmp_path / "m")
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build or save tiny is not ours to test
        pytest.skip(f"tiny {family} not buildable: {type(e).__name__}")
    try:
        plan = plan_gguf(tmp_path / "m", metadata=False)
    except FormatError:
        pytest.skip(f"llama.cpp's converter does not convert {family}")
    kinds = source_types(plan, get_format(Format.GGUF).tensor_types(plan, GgmlType.Q4_0, True))
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(0, min(vocab, 250), (4, 16), generator=torch.Generator().manual_seed(3))
    rows = {}
    for iters in (0, 10):
        cfg = CalibrationConfig(num_samples=4, seq_len=16, batch_size=2, reconstruct_iters=iters)
        spill, reports = Spill.beside(tmp_path / "x.gguf"), {}
        try:
            assert streamed_sources(tmp_path / "m", plan, ids, cfg, kinds, ImportanceSearch.DIRECT, spill, False,
                                    reports=reports) is not None
            rows[iters] = {k: spill[k][1].clone() for k in spill}
        finally:
            spill.close()
        assert bool(reports) == bool(iters)
    assert sorted(rows[0]) == sorted(rows[10])
    assert any(not torch.equal(rows[0][k], rows[10][k]) for k in rows[0]), "no code moved"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt2"])
def test_families_reconstruct(family, tmp_path):
    """MoE experts (one by one) and GPT-2's Conv1D go through the same reconstruction."""
    _family_runs(family, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", __import__("helpers.families", fromlist=["x"]).decoder_only_types())
def test_every_family_reconstructs(family, tmp_path):
    _family_runs(family, tmp_path)
