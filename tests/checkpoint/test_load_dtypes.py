"""lowbit.load and ``lowbit inspect --strict`` refuse tensors that contradict the config:
the stored dtype of every tensor is the one its layout writes for the config's scheme, so codes of
another element format are an error naming the tensor, never a silently wrong model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from helpers.models import tiny_llama
from lowbit.errors import FormatError
from lowbit.formats import get_layout
from lowbit.formats.lowbit_layout import code_dtype
from lowbit.schemes import get_scheme
from helpers.cli import run


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(_ids()).logits


def _save(scheme: str, fmt: str, out: Path) -> Path:
    lowbit.save(lowbit.quantize(tiny_llama(), scheme), out, format=fmt)
    return out


def _claim_scheme(folder: Path, fmt: str, scheme: str) -> None:
    """Rewrite config.json as if the folder held ``scheme`` (the tensors are left as they are)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = get_layout(fmt).quantization_config(get_scheme(scheme), ignore=["lm_head"])
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
@pytest.mark.parametrize("stored,claimed,got,want", [
    ("w8a8-fp8-dynamic", "w8a8-int8-dynamic", "float8_e4m3fn", "int8"),
    ("w8a8-int8-dynamic", "w8a8-fp8-dynamic", "int8", "float8_e4m3fn"),
])
def test_codes_of_another_format_are_refused(capsys, tmp_path, fmt, stored, claimed, got, want):
    folder = _save(stored, fmt, tmp_path / "ck")
    _claim_scheme(folder, fmt, claimed)  # same shapes, same scale layout: only the dtype tells
    with pytest.raises(FormatError, match=rf"tensor 'model\.layers\.\d+\.\S+\.weight\S*'.* has dtype "
                                          rf"torch\.{got}, expected torch\.{want}"):
        lowbit.load(folder)
    code, out, _ = run(capsys, "inspect", folder, "--strict")
    assert code == 1 and f"has dtype torch.{got}, expected torch.{want}" in out
    assert "is missing" not in out  # a layer that cannot be read is reported once, not also as missing
    code, _, err = run(capsys, "eval", folder, "--limit", 10, "--lastword", 0, "--no-progress")
    assert code == 2 and f"torch.{got}" in err.strip().splitlines()[-1]


def test_lowbit_format_stores_codes_in_their_dtype(tmp_path):
    for scheme in ("w8a8-int8-dynamic", "w8a8-fp8-dynamic", "mxfp8", "w8a16"):
        folder = _save(scheme, "lowbit", tmp_path / scheme)
        t = load_file(str(folder / "lowbit-model.safetensors"))
        codes = t["model.layers.0.mlp.down_proj.weight_codes"]
        assert codes.dtype == code_dtype(get_scheme(scheme).weights) != torch.uint8
        # the same run model-free writes the same typed tensors
        src = tmp_path / f"src-{scheme}"
        tiny_llama().save_pretrained(src)
        mf = lowbit.quantize_checkpoint(src, tmp_path / f"mf-{scheme}", scheme=scheme, workers=0, progress=False)
        assert load_file(str(mf / "lowbit-model.safetensors"))["model.layers.0.mlp.down_proj.weight_codes"].dtype \
            == codes.dtype


def test_format_version_1_folders_still_load(tmp_path):
    folder = _save("w8a8-fp8-dynamic", "lowbit", tmp_path / "ck")
    ref = _logits(lowbit.load(folder, backend="reference"))
    f = folder / "lowbit-model.safetensors"
    t = load_file(str(f))
    t = {k: v.view(torch.uint8) if k.endswith(".weight_codes") else v for k, v in t.items()}  # as version 1 wrote
    save_file(t, str(f), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(_logits(lowbit.load(folder, backend="reference")), ref)
    cfg["quantization_config"]["format_version"] = 2  # version 2 with untyped codes: refused
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"weight_codes.* has dtype torch\.uint8, expected torch\.float8_e4m3fn"):
        lowbit.load(folder)


def test_fp8_float_tensor_is_refused(capsys, tmp_path):
    folder = _save("w8a16", "compressed-tensors", tmp_path / "ck")
    t = load_file(str(folder / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.float8_e4m3fn)  # cast in silently before
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"tensor 'model\.norm\.weight'.* has dtype torch\.float8_e4m3fn"):
        lowbit.load(folder)
    code, out, _ = run(capsys, "inspect", folder, "--strict")
    assert code == 1 and "'model.norm.weight'" in out and "F8_E4M3" in out
