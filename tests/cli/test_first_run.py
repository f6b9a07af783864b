"""What a new user meets first: quantizing twice is refused, CLI errors in the CLI's words, a CLI
that answers --help without importing torch, calibration progress, sizes in one unit, a report
plot that shows the differences."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowbit
from helpers.cli import run
from helpers.eval_fixtures import save_tiny_folder
from lowbit.errors import FormatError, OptionRef, QuantizationError



def test_quantizing_a_quantized_model_is_refused(llama):
    q = lowbit.quantize(llama, "nvfp4-e5m3")
    with pytest.raises(QuantizationError, match=r"already quantized \(14 lowbit layers.*nvfp4-e5m3.*fresh float model"):
        lowbit.quantize(q, "w8a8-int8", torch.randint(0, 256, (2, 16)), num_samples=2, seq_len=16)


def test_option_ref_spells_python_and_cli():
    e = FormatError("folder {x!r} exists (pass {overwrite}); or use {fmt}", overwrite=OptionRef("overwrite"),
                    fmt=OptionRef("format", "lowbit"))
    assert str(e) == "folder {x!r} exists (pass overwrite=True); or use format='lowbit'"
    assert e.cli_message() == "folder {x!r} exists (pass --overwrite); or use --format lowbit"
    assert FormatError("plain {braces}").cli_message() == "plain {braces}"


def test_cli_errors_name_flags_not_keywords(capsys, tmp_path):
    src = save_tiny_folder(tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    capsys.readouterr()
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", out)
    assert code == 2 and "--overwrite" in err and "overwrite=True" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(FormatError, match=r"overwrite=True"):
        lowbit.save(lowbit.quantize(lowbit.load_model(src)[0], "w8a16"), out)


def test_debug_is_in_the_help(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--debug" in out


@pytest.mark.subprocess
def test_help_and_path_errors_do_not_import_torch(tmp_path):
    probe = ("import sys\nfrom lowbit.cli import main\n"
             "for args in (['--help'], ['quantize', '--help'], ['eval', sys.argv[1]], "
             "['quantize', sys.argv[1], '--scheme', 'w8a16'], ['inspect', sys.argv[1]]):\n"
             "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "missing")], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH", r.stdout + r.stderr
    assert r.stderr.count("error:") == 3


def test_calibration_shows_progress_per_layer(llama, capfd):
    lowbit.quantize(llama, "w8a8-int8", torch.randint(0, 256, (2, 16)), num_samples=2, seq_len=16, progress=True)
    err = capfd.readouterr().err
    assert "calibrating w8a8-int8" in err and "/2 [" in err and "layer" in err
    lowbit.quantize(copy.deepcopy(llama.__class__(llama.config)), "w8a8-int8", torch.randint(0, 256, (2, 16)),
                    num_samples=2, seq_len=16, progress=False)
    assert "calibrating" not in capfd.readouterr().err


def test_inspect_and_quantize_report_the_same_size(capsys, tmp_path):
    src = save_tiny_folder(tmp_path / "m")
    code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q", "--json")
    assert code == 0
    size = json.loads(out)["size_bytes"]
    code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q2")
    said = re.search(r"weights ([\d.]+ [KMG]?B) on disk", out).group(1)
    code, out, _ = run(capsys, "inspect", tmp_path / "q")
    assert code == 0 and "MiB" not in out
    assert re.search(r"weights on disk ([\d.]+ [KMG]?B)", out).group(1) == said
    from lowbit.cli.common import human_bytes

    assert said == human_bytes(size)


def _iv(est, half):
    return {"estimate": est, "low": est - half, "high": est + half, "level": 0.95}


def _report(schemes):
    rows = []
    for name, ppl, kld, layers in schemes:
        change = 100 * (ppl / 40.0 - 1)
        rows.append({"scheme": name, "status": "ok", "perplexity": ppl, "ppl_change_pct": change,
                     "ppl_change_interval": _iv(change, 1.0), "kld": _iv(kld, kld / 4),
                     "lastword_accuracy": 0.5, "lastword_interval": _iv(0.5, 0.3), "layers": layers})
    return {"float": {"perplexity": 40.0, "tokens_scored": 100, "lastword_accuracy": 0.5, "lastword_examples": 4,
                      "lastword_interval": _iv(0.5, 0.3)},
            "schemes": rows, "model": {"path": "tiny"}}


def test_report_plot_shows_differences_and_names_unmeasured_schemes():
    import matplotlib.pyplot as plt

    from lowbit.report.writer import build_figure

    fig = build_figure(_report([("nvfp4", 41.0, 0.2, {"a": 20.0, "b": 18.0}), ("w8a8-int8", 40.4, 0.04, {})]))
    kld_ax, ppl_ax, _, sqnr_ax = fig.axes
    assert [round(b.get_height(), 6) for b in kld_ax.patches] == [0.2, 0.04]  # KLD bars ...
    (bars,) = kld_ax.collections  # ... with their intervals as error bars
    assert [tuple(seg[:, 1].round(6)) for seg in bars.get_segments()] == [(0.15, 0.25), (0.03, 0.05)]
    assert [round(b.get_height(), 6) for b in ppl_ax.patches] == [2.5, 1.0]  # changes, not perplexities
    labels = [t.get_text() for t in sqnr_ax.get_legend().get_texts()]
    assert labels == ["nvfp4"]                                  # only schemes with a drawn line
    notes = " ".join(t.get_text() for t in sqnr_ax.texts)
    assert "not measured" in notes and "w8a8-int8" in notes
    assert any("+2.5%" in t.get_text() for t in ppl_ax.texts)
    plt.close(fig)


@pytest.mark.parametrize("command", ["eval", "compare"])
@pytest.mark.parametrize("limit", ["0", "-5"])
def test_limit_must_be_positive_before_any_work(capsys, command, limit, tmp_path):
    code, _, err = run(capsys, command, tmp_path / "no-such-model", "--limit", limit)
    assert code == 2 and "--limit must be a positive" in err and len(err.strip().splitlines()) == 1
