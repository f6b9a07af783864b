"""Bad input never costs data: every CLI path answers a broken folder, a refused write
or a bad option with one ``error:`` line naming the file, tensor or option, exit code 2, and
leaves nothing half-written; the source is never overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.cli import assert_one_error, copy_folder, leftovers, run, tiny  # noqa: F401  (tiny: fixture)

TEXT = "\n".join(f"one two three four five six seven eight nine ten and the story of the {w} ended there."
                 for w in ("garden", "letter", "carriage", "evening", "sister", "window"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "eval.txt"
    p.write_text(TEXT)
    return p


# ---------------------------------------------------------------------------- broken source folders
def _not_json(d: Path) -> str:
    (d / "config.json").write_text('{"model_type": "llama",')
    return "config.json"


def _truncated(d: Path) -> str:
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-100])
    return "model.safetensors"


def _shape(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the stored MLP weights are 128 wide
    (d / "config.json").write_text(json.dumps(cfg))
    return "model config says (96, 64)"


def _bin_only(d: Path) -> str:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    return "pytorch_model.bin"


def _int32(d: Path) -> str:
    t = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    t[name] = (t[name] * 1000).to(torch.int32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return name


def _outside(d: Path) -> str:
    (d / "model.safetensors").rename(d.parent / "outside.safetensors")
    names = list(load_file(str(d.parent / "outside.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "../outside.safetensors" for n in names}}))
    return "../outside.safetensors"


def _absolute(d: Path) -> str:
    _outside(d)
    target = str(d.parent / "outside.safetensors")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {n: target for n in idx["weight_map"]}
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return target


BROKEN = {"not-json": _not_json, "truncated": _truncated, "shape": _shape, "bin-only": _bin_only,
          "int32": _int32, "index-outside": _outside, "index-absolute": _absolute}
COMMANDS = {
    "quantize": lambda src, out, text: ["quantize", src, "--scheme", "w8a16", "--output", out],
    "quantize-calibrated": lambda src, out, text: ["quantize", src, "--scheme", "w8a8-int8", "--output", out,
                                                   "--calib", text, "--calib-samples", 2, "--calib-seq-len", 16],
    "quantize-model-free": lambda src, out, text: ["quantize", src, "--scheme", "w8a16", "--model-free",
                                                   "--output", out],
    "eval": lambda src, out, text: ["eval", src, "--text", text, "--limit", 20, "--lastword", 0, "--no-progress"],
    "compare": lambda src, out, text: ["compare", src, "--schemes", "w8a16", "--text", text, "--limit", 20,
                                       "--lastword", 0, "-o", out, "--no-progress"],
}
# model-free quantization builds no model, so it has no config shapes to compare the weights with
CASES = [(case, cmd) for case in BROKEN for cmd in COMMANDS if (case, cmd) != ("shape", "quantize-model-free")]


@pytest.mark.parametrize("case,command", CASES)
def test_broken_folder_is_one_error_line(capsys, monkeypatch, tiny, text_file, tmp_path, case, command):
    src = copy_folder(tiny, tmp_path / "src")
    names = BROKEN[case](src)
    before = {p.name: p.read_bytes() for p in src.parent.rglob("*") if p.is_file()}

    def no_unpickling(*a, **k):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    out = tmp_path / "out"
    code, _, err = run(capsys, *COMMANDS[command](src, out, text_file))
    line = assert_one_error(code, err, names)
    if case == "bin-only":
        assert "safetensors" in line
    if case == "int32":
        assert "I32" in line
    assert leftovers(out) == []
    assert {p.name: p.read_bytes() for p in src.parent.rglob("*") if p.is_file()} == before


def test_inspect_of_a_broken_folder_is_one_error_line(capsys, tiny, tmp_path):
    import lowbit
    from lowbit.models import load_model

    q = tmp_path / "q"
    lowbit.save(lowbit.quantize(load_model(tiny)[0], "w8a16"), q)
    capsys.readouterr()
    for case, src in (("not-json", tiny), ("not-json", q), ("truncated", q)):
        d = copy_folder(src, tmp_path / f"{case}-{src.name}")
        if case == "truncated":
            raw = (d / "lowbit-model.safetensors").read_bytes()
            (d / "lowbit-model.safetensors").write_bytes(raw[:-100])
            names = "lowbit-model.safetensors"
        else:
            names = BROKEN[case](d)
        if case == "truncated":  # a damaged shard of a readable folder is a reported inconsistency
            code, out, err = run(capsys, "inspect", d, "--strict")
            assert code == 1 and names in out and "truncated" in out and "Traceback" not in err
            continue
        code, _, err = run(capsys, "inspect", d)
        assert_one_error(code, err, names)


@pytest.mark.parametrize("limit", [0, -5])
def test_eval_limit_must_be_positive(capsys, tiny, text_file, limit):
    code, _, err = run(capsys, "eval", tiny, "--text", text_file, "--limit", limit, "--no-progress")
    assert_one_error(code, err, "--limit", str(limit))


# ---------------------------------------------------------------------------- the source is never the output
def _outputs_onto_source(src: Path):
    link = src.parent / "link"
    link.symlink_to(src, target_is_directory=True)
    return [src, link, Path("..") / src.name, Path("."), src.parent]  # relative to the cwd, src


@pytest.mark.parametrize("model_free", [False, True])
def test_output_onto_the_source_is_refused(capsys, monkeypatch, tiny, tmp_path, model_free):
    src = copy_folder(tiny, tmp_path / "work" / "src")
    monkeypatch.chdir(src)  # relative paths are resolved from here
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    extra = ["--model-free"] if model_free else []
    for out in _outputs_onto_source(src):
        for more in ([], ["--overwrite"]):
            code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", "--output", out, *extra, *more)
            assert_one_error(code, err, str(src), "--output")
            assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    # an existing entry inside the source (here its own shard) is the source too
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", "--output", src / "model.safetensors",
                       "--overwrite", *extra)
    assert_one_error(code, err, "model.safetensors", "--output")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert not list(src.parent.glob(".*lowbit*"))


def test_lowbit_save_refuses_the_folder_the_model_came_from(tiny, tmp_path):
    import lowbit
    from lowbit.errors import FormatError
    from lowbit.models import load_model

    src = copy_folder(tiny, tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    model, _ = load_model(src)
    q = lowbit.quantize(model, "w8a16")
    with pytest.raises(FormatError, match="would overwrite the source"):
        lowbit.save(q, src, overwrite=True)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
