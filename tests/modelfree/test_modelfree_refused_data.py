"""A model-free run refused for a data problem of the source leaves nothing behind (no output,
no temporary folder, no lock), wherever the problem is found; a refused write keeps the
temporary folder for a resumed run."""

from __future__ import annotations

import errno

import pytest
import torch

from helpers.cli import assert_one_error, leftovers, run
from helpers.modelfree import mf, no_output
from helpers.models import tiny_llama
from lowbit.errors import FormatError, OutputError, QuantizationError
from lowbit.modelfree.ranks import RankFailed, is_data_error


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """hidden 64: w4a16's group of 128 does not divide it (compressed-tensors needs whole groups)."""
    src = tmp_path_factory.mktemp("narrow") / "src"
    tiny_llama().save_pretrained(src, max_shard_size="100KB")
    return src


def test_a_layout_refusing_the_shapes_leaves_no_temporary_folder(narrow, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FormatError, match="input dimension 64 to be a multiple of the group size 128"):
        mf(narrow, out, "w4a16", format="compressed-tensors")
    assert no_output(out)


def test_cli_shape_and_nan_refusals_leave_nothing(capsys, narrow, tmp_path):
    out = tmp_path / "ct"
    code, _, err = run(capsys, "quantize", narrow, "--scheme", "w4a16", "--model-free", "--format",
                       "compressed-tensors", "--output", out)
    assert_one_error(code, err, "multiple of the group size 128")
    assert leftovers(out) == []
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight[1, 2] = float("nan")
    m.save_pretrained(tmp_path / "nan", max_shard_size="100KB")
    out = tmp_path / "nanout"
    code, _, err = run(capsys, "quantize", tmp_path / "nan", "--scheme", "w8a16", "--model-free", "--output", out)
    assert_one_error(code, err, "model.layers.0.self_attn.k_proj.weight", "NaN")
    assert leftovers(out) == []


def test_which_errors_abandon_the_output():
    assert is_data_error(QuantizationError("NaN"))
    assert is_data_error(FormatError("shape"))
    assert not is_data_error(OutputError(errno.ENOSPC, "No space left on device"))  # resumable
    assert not is_data_error(OSError(errno.ENOSPC, "No space left on device"))
    assert is_data_error(RankFailed("rank 1 failed", data=True))
    assert not is_data_error(RankFailed("rank 1 failed", data=False))


@pytest.mark.subprocess
def test_a_nan_in_worker_processes_is_the_one_error_and_leaves_nothing(tmp_path):
    """The pool is closed on the error, then again at the run's end: the second close must not
    replace the QuantizationError with its own (a shut-down executor holds no processes)."""
    from lowbit.modelfree import RunOptions

    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    src = tmp_path / "src"
    m.save_pretrained(src, max_shard_size="100KB")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN"):
        mf(src, out, "nvfp4-e5m3", workers=2,
           run_options=RunOptions(pool_min_bytes=0, pool_min_workers=2, part_bytes=20_000))
    assert no_output(out)
