"""One default per option, whatever the entry point: the Python API, ``lowbit quantize`` and
``lowbit compare`` take SmoothQuant and the calibration budget from one place."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder
from lowbit.calibration import CalibrationConfig
from lowbit.checkpoint import load
from lowbit.cli import main
from lowbit.errors import QuantizationError
from lowbit.report.compare import CompareOptions, quantize_with_options
from lowbit.algorithms.smoothquant.defaults import FLOAT_ALPHA, INT_ALPHA

TEXT = "\n".join(f"the {w} was long and the day ended with a quiet {w} by the window of the house."
                 for w in ("garden", "letter", "carriage", "evening", "sister", "window", "morning", "street"))


def _calib():
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))


def _alphas(q) -> set:
    return {g.alpha for g in q.lowbit_calibration.groups.values()}


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("scheme, alpha", [("w8a8-int8", INT_ALPHA), ("w8a8-fp8", FLOAT_ALPHA)])
def test_python_default_smooths_like_the_cli(llama, scheme, alpha):
    kw = dict(num_samples=4, seq_len=32)
    default = lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), **kw)
    assert default.lowbit_calibration.smoothquant == alpha and _alphas(default) == {alpha, None}  # o_proj: no mapping
    assert _same(default, lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), smoothquant=alpha, **kw))
    off = lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), smoothquant="none", **kw)
    assert _alphas(off) == {None} and not _same(default, off)
    assert _same(off, lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), smoothquant=None, **kw))


def test_default_for_schemes_without_static_inputs_is_plain_rtn(llama):
    assert _same(lowbit.quantize(copy.deepcopy(llama), "w8a8-int8-dynamic", _calib()),
                 lowbit.quantize(copy.deepcopy(llama), "w8a8-int8-dynamic"))


def test_bad_smoothquant_names_the_accepted_values(llama):
    with pytest.raises(QuantizationError, match="'auto', 'default' or 'none'"):
        lowbit.quantize(llama, "w8a8-int8", _calib(), smoothquant="off")


def test_cli_quantize_writes_what_the_python_default_makes(tmp_path):
    src = save_tiny_folder(tmp_path / "m")
    (tmp_path / "calib.txt").write_text(TEXT)
    try:
        main(["quantize", str(src), "--scheme", "w8a8-int8", "--calib", str(tmp_path / "calib.txt"),
              "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(tmp_path / "cli")])
    except SystemExit as e:
        assert not e.code
    model, tok = lowbit.models.load_model(src)
    api = lowbit.quantize(model, "w8a8-int8", str(tmp_path / "calib.txt"), tokenizer=tok, num_samples=4, seq_len=32)
    assert _same(load(tmp_path / "cli", backend="reference"), api)


def test_compare_defaults_are_the_api_defaults(llama):
    opts = CompareOptions(schemes=["w8a8-int8"], calib=None)
    assert (opts.calib_samples, opts.calib_seq_len) == (CalibrationConfig.num_samples, CalibrationConfig.seq_len)
    opts = CompareOptions(schemes=["w8a8-int8"], calib_samples=4, calib_seq_len=32)
    calib = "\n".join([TEXT] * 8)
    tok = byte_tokenizer()
    import tempfile, pathlib

    with tempfile.TemporaryDirectory() as d:
        f = pathlib.Path(d) / "c.txt"
        f.write_text(calib)
        opts.calib = str(f)
        q, calibrated, sq = quantize_with_options(copy.deepcopy(llama), "w8a8-int8", tok, opts)
        api = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", str(f), tokenizer=tok, num_samples=4, seq_len=32)
    assert calibrated and sq == INT_ALPHA and _same(q, api)


@pytest.mark.parametrize("command", ["compare_cmd", "quantize_cmd"])
def test_help_states_the_one_calibration_budget(command):
    import inspect

    from lowbit.cli import compare_cmd, quantize_cmd

    fn = getattr({"compare_cmd": compare_cmd, "quantize_cmd": quantize_cmd}[command], command)
    params = inspect.signature(fn).parameters
    assert f"default {CalibrationConfig.num_samples}," in params["calib_samples"].default.help
    assert f"default {CalibrationConfig.seq_len}," in params["calib_seq_len"].default.help
