"""Streamed quantization (lowbit.quantize_checkpoint) under a recipe: resolved on the skeleton as
lowbit.quantize resolves it on the loaded model, calibrated or round-to-nearest, it writes the
tensors and config of the in-memory path bit for bit; the recipe is fingerprinted (resume) and a
bad recipe is one error before anything is written."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.folders import assert_same_tensors, folder_tensors
from helpers.modelfree import no_output
from helpers.models import tiny_llama
from helpers.streamed import config_of, in_memory, write_folder
from lowbit.recipes import Recipe, RecipeError

TOKENS = torch.randint(0, 256, (10, 32), generator=torch.Generator().manual_seed(0))
FP8_DOWN = {r"re:.*mlp\.down_proj": "w8a8-fp8", "default": "nvfp4"}  # GPTQ + static FP8 input scales
ATTN8 = {r"re:.*self_attn": "w8a8-int8-dynamic", "default": "w4a16"}  # round-to-nearest only


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return write_folder(tiny_llama(num_hidden_layers=3, hidden_size=128, intermediate_size=256),
                        tmp_path_factory.mktemp("streamed") / "src")


def _same(a, b) -> None:
    assert_same_tensors(folder_tensors(a), folder_tensors(b))
    assert config_of(a) == config_of(b)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
def test_calibrated_recipe_equals_in_memory(llama_src, tmp_path, fmt):
    a = in_memory(llama_src, tmp_path / "mem", FP8_DOWN, fmt, TOKENS)
    b = lowbit.quantize_checkpoint(llama_src, tmp_path / "str", FP8_DOWN, fmt, calibration=TOKENS)
    _same(a, b)
    assert len(list(b.glob("*.safetensors"))) == 4  # streamed: a shard per decoder layer and one for the rest
    groups = config_of(b)["quantization_config"]["config_groups"]
    assert sorted(len(g["targets"]) for g in groups.values()) == [3, 18]


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
def test_rtn_recipe_is_model_free_and_equals_in_memory(tmp_path, fmt):
    src = write_folder(tiny_llama(num_hidden_layers=2, hidden_size=128, intermediate_size=256), tmp_path / "src",
                       dtype=torch.float32)  # the dtype lowbit.load_model quantizes in
    model, tok = lowbit.load_model(src)
    a = lowbit.save(lowbit.quantize(model, ATTN8), tmp_path / "mem", format=fmt, tokenizer=tok, source_dir=src)
    b = lowbit.quantize_checkpoint(src, tmp_path / "str", Recipe.of(ATTN8), fmt)
    assert_same_tensors(folder_tensors(a), folder_tensors(b))
    assert config_of(a)["quantization_config"] == config_of(b)["quantization_config"]


def test_a_default_no_linear_gets_does_not_make_the_run_calibrate(llama_src, tmp_path, monkeypatch):
    """Every linear claimed by a dynamic scheme: round-to-nearest (model-free), as in memory,
    though the recipe's unused default would calibrate (w4a16 with data: GPTQ)."""
    import lowbit.streamed.run as run

    monkeypatch.setattr(run, "streamed", lambda *a, **k: pytest.fail("streamed"))
    recipe = {"Linear": "w8a8-int8-dynamic", "default": "w4a16"}
    b = lowbit.quantize_checkpoint(llama_src, tmp_path / "str", recipe, calibration=TOKENS)
    a = lowbit.quantize_checkpoint(llama_src, tmp_path / "plain", "w8a8-int8-dynamic")
    assert_same_tensors(folder_tensors(a), folder_tensors(b))


def test_bad_recipes_write_nothing(llama_src, tmp_path):
    with pytest.raises(RecipeError, match="matches no quantizable linear"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "a", {r"re:.*nope": "w8a8-fp8", "default": "nvfp4"},
                                   calibration=TOKENS)
    assert no_output(tmp_path / "a")
    with pytest.raises(RecipeError, match="splits modules"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "b", {r"re:.*k_proj": "w8a8-fp8", "default": "nvfp4"},
                                   calibration=TOKENS)
    assert no_output(tmp_path / "b")
    with pytest.raises(RecipeError, match="recipe file"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "c", str(tmp_path / "missing.yaml"), calibration=TOKENS)
    assert no_output(tmp_path / "c")


def test_the_recipe_is_fingerprinted(llama_src):
    from lowbit.modelfree.source import Checkpoint
    from lowbit.streamed import CalibrationChoice, plan_checkpoint
    from lowbit.streamed.api import fingerprint

    ck, fps = Checkpoint(llama_src), set()
    for r in (FP8_DOWN, {r"re:.*mlp\.down_proj": "w8a8-int8", "default": "nvfp4"}, "nvfp4", {"Linear": "nvfp4"}):
        plan = plan_checkpoint(llama_src, "unused", Recipe.of(r), "lowbit", CalibrationChoice(TOKENS))
        try:
            fps.add(fingerprint(plan, ck, TOKENS, None, 1, None))
        finally:
            plan.planned.close()
    assert len(fps) == 4


def test_kill_then_resume_a_recipe_gives_the_same_bytes(llama_src, tmp_path, monkeypatch):
    from lowbit.streamed.output import StreamOutput

    whole = lowbit.quantize_checkpoint(llama_src, tmp_path / "whole", FP8_DOWN, calibration=TOKENS)
    real = StreamOutput.write_layer

    def dies_after_two(self, i, *a, **k):
        if i == 2:
            raise KeyboardInterrupt
        return real(self, i, *a, **k)

    monkeypatch.setattr(StreamOutput, "write_layer", dies_after_two)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        lowbit.quantize_checkpoint(llama_src, out, FP8_DOWN, calibration=TOKENS)
    seen = []
    monkeypatch.setattr(StreamOutput, "write_layer", lambda self, i, *a, **k: (seen.append(i), real(self, i, *a, **k)))
    lowbit.quantize_checkpoint(llama_src, out, FP8_DOWN, calibration=TOKENS)
    assert seen == [2]  # layers 0 and 1 were not computed again
    for f in sorted(whole.iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
