"""A refusal before any layer is written leaves no temporary folder on the streamed path."""

from __future__ import annotations

import torch

from helpers.cli import run
from helpers.eval_fixtures import byte_tokenizer
from helpers.models import tiny_llama


def test_a_nan_weight_is_one_error_and_leaves_nothing(capsys, tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    src = tmp_path / "src"
    model.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    capsys.readouterr()
    out = tmp_path / "out"
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a8-int8", "--output", out, "--calib-samples", "2",
                       "--calib-seq-len", "32")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
