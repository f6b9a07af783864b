"""One rule of what a GGUF file is (``lowbit.formats.gguf.is_gguf_file``: its magic bytes),
asked alike by ``lowbit.load``, ``lowbit.models.load_model``, ``lowbit eval`` and ``lowbit
inspect``: a GGUF file without the ``.gguf`` suffix is one; a ``*.gguf`` file that is not GGUF is
one FormatError line naming it, wherever it is given."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lowbit
from helpers.cli import assert_one_error, run
from lowbit.errors import FormatError
from lowbit.formats.gguf import is_gguf_file


def _tiny_gguf(path):
    """A GGUF file of one F32 tensor (gguf-py's writer; no model behind it)."""
    import gguf

    w = gguf.GGUFWriter(path=None, arch="llama")
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def files(tmp_path):
    named = _tiny_gguf(tmp_path / "m.gguf")
    bare = tmp_path / "m-no-suffix"
    bare.write_bytes(named.read_bytes())
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"not a gguf file")
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    return named, bare, fake, other


def test_the_magic_decides_and_a_misnamed_file_is_one_error(files, tmp_path):
    named, bare, fake, other = files
    assert is_gguf_file(named) and is_gguf_file(bare)
    assert not is_gguf_file(other) and not is_gguf_file(tmp_path) and not is_gguf_file(tmp_path / "missing.gguf")
    with pytest.raises(FormatError) as e:
        is_gguf_file(fake)
    assert "x.gguf" in str(e.value) and "not a GGUF file" in str(e.value) and "\n" not in str(e.value)
    upper = tmp_path / "Y.GGUF"
    upper.write_bytes(b"GGU")
    with pytest.raises(FormatError, match="Y.GGUF"):
        is_gguf_file(upper)


def test_load_and_load_model_give_the_same_error_for_a_misnamed_file(files):
    _, _, fake, _ = files
    for call in (lambda: lowbit.load(fake), lambda: lowbit.load_model(fake)):
        with pytest.raises(FormatError) as e:
            call()
        assert "x.gguf" in str(e.value) and "not a GGUF file" in str(e.value) and "\n" not in str(e.value)


def test_cli_eval_and_inspect_name_a_misnamed_file(files, capsys):
    _, _, fake, _ = files
    for args in (("eval", fake, "--limit", "8"), ("inspect", fake)):
        code, _, err = run(capsys, *args)
        assert_one_error(code, err, "x.gguf", "not a GGUF file")


def test_inspect_reads_a_gguf_file_without_the_suffix(files, capsys):
    named, bare, _, _ = files
    reports = []
    for path in (named, bare):
        code, out, err = run(capsys, "inspect", path, "--json")
        assert code == 0, err
        r = json.loads(out)
        reports.append((r["format"], r["tensors"]))
    assert reports[0] == reports[1] == ("gguf", {"blk.0.attn_norm.weight": "F32"})
