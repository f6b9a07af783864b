"""Bad input never costs data: every CLI path answers a broken folder, a refused write
or a bad option with one ``error:`` line naming the file, tensor or option, exit code 2, and
leaves nothing half-written; the source is never overwritten."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.cli import assert_one_error, copy_folder, leftovers, run, tiny  # noqa: F401  (tiny: fixture)
from helpers.full_disk import FullDisk

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


# ---------------------------------------------------------------------------- refused writes
REFUSALS = {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system",
            errno.EACCES: "Permission denied"}
CALIBRATED = ["--scheme", "w8a8-int8", "--calib-samples", 2, "--calib-seq-len", 16]
# each entry point of `lowbit quantize`, and a file it writes (the weights: a Rust writer's error,
# or pwrite's, that names no file; and text files)
ENTRIES = {"streamed": (CALIBRATED, "lowbit-model-00001-of-00003.safetensors"),
           "in-memory": ([*CALIBRATED, "--in-memory"], "auto-00000.safetensors"),
           "model-free": (["--scheme", "w8a16", "--model-free"], "lowbit-model.safetensors")}
REFUSED = [(entry, errno.ENOSPC) for entry in ENTRIES] + [("streamed", errno.EROFS), ("streamed", errno.EACCES),
                                                           ("model-free", errno.EROFS)]


@pytest.mark.parametrize("entry,code", REFUSED)
def test_a_refused_write_is_one_error_line(capsys, monkeypatch, tiny, tmp_path, entry, code):
    """A full disk, a read-only file system, no permission: one line naming the file, exit 2;
    what resumes (streamed, model-free) keeps its temporary folder, names it, and the same command
    completes once writes succeed; the in-memory path leaves nothing."""
    args, site = ENTRIES[entry]
    out = tmp_path / "out"
    tmp = out.parent / f".{out.name}.lowbit-tmp"
    disk = FullDisk(monkeypatch, fail_at=1, only=site if code == errno.ENOSPC else "config.json", error=code)
    rc, _, err = run(capsys, "quantize", tiny, *args, "--output", out)
    assert disk.refused
    line = assert_one_error(rc, err, REFUSALS[code], f"cannot write {tmp / disk.sites[-1]}", str(out))
    assert not out.exists()
    if entry != "model-free":  # model-free fills its shards in place, under .partial names it resumes into
        assert not list(out.parent.rglob("*.partial"))
    if entry == "in-memory":
        assert leftovers(out) == []
        return
    assert leftovers(out) == [tmp.name] and f"stay in {tmp}: run the same command again to resume" in line
    disk.fail_at = None
    rc, _, err = run(capsys, "quantize", tiny, *args, "--output", out)
    assert rc == 0, err
    assert leftovers(out) == ["out"]


def test_lowbit_save_onto_a_full_disk_raises_one_line_and_leaves_nothing(monkeypatch, tiny, tmp_path):
    import lowbit
    from lowbit.errors import OutputError
    from lowbit.models import load_model

    model, tok = load_model(tiny)
    q = lowbit.quantize(model, "w8a16")
    out = tmp_path / "out"
    for site in ("config.json", "tokenizer (save_pretrained)", "auto-00000.safetensors"):  # the weights, unnamed yet
        disk = FullDisk(monkeypatch, fail_at=1, only=site)
        with pytest.raises(OutputError) as e:
            lowbit.save(q, out, tokenizer=tok, source_dir=tiny)
        assert disk.refused
        named = Path(disk.refused[0]).parent if site.startswith("tokenizer") else Path(disk.refused[0])
        assert str(e.value) == (f"cannot write {str(named).removesuffix('.partial')} (output folder {out}): "
                                f"No space left on device")
        assert leftovers(out) == []
        monkeypatch.undo()
    lowbit.save(q, out, tokenizer=tok, source_dir=tiny)
    assert leftovers(out) == ["out"]


@pytest.mark.parametrize("site", ["report.json", "report.png"])
def test_compare_onto_a_full_disk_is_one_error_line(capsys, monkeypatch, tiny, text_file, tmp_path, site):
    out = tmp_path / "report"
    disk = FullDisk(monkeypatch, fail_at=1, only=site)
    code, _, err = run(capsys, "compare", tiny, "--schemes", "w8a16", "--text", text_file, "--limit", 20,
                       "--lastword", 0, "-o", out, "--no-progress")
    assert disk.refused
    assert_one_error(code, err, f"cannot write {out / site} (output folder {out}): No space left on device")
    written = sorted(p.name for p in out.iterdir())
    assert written == ([] if site == "report.json" else ["report.json"])  # each file whole or absent
    if written:
        json.loads((out / "report.json").read_text())
