"""Model-free quantization under a recipe (lowbit.modelfree.mixed): every tensor quantized with the
scheme lowbit.quantize gives its linear, the config a group per scheme, so the folder holds the
tensors and config of lowbit.save(lowbit.quantize(model, recipe)) bit for bit; bad recipes are
one error before anything is written."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lowbit
from helpers.folders import assert_same_tensors, folder_tensors
from helpers.modelfree import mf, no_output
from helpers.models import tiny_llama
from lowbit.errors import SchemeError
from lowbit.recipes import Recipe, RecipeError

ATTN8 = {r"re:.*self_attn": "w8a8-int8-dynamic", "default": "w4a16"}
FP8_DOWN = {r"re:.*mlp\.down_proj": "w8a8-fp8-dynamic", "default": "nvfp4a16"}  # NVFP4 global scales shared
LAYER0_FLOAT = {r"re:.*self_attn": "w8a8-int8-dynamic", "default": "w4a16", "ignore": [r"re:.*layers\.0\.mlp\."]}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(hidden_size=128, intermediate_size=256)  # the group size of w4a16 divides every input


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "tiny"
    model.save_pretrained(d, max_shard_size="100KB")
    return d


def _qcfg(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
@pytest.mark.parametrize("recipe", [ATTN8, FP8_DOWN, LAYER0_FLOAT], ids=["attn8", "fp8-down", "layer0-float"])
def test_recipe_equals_in_memory(model, sharded, tmp_path, recipe, fmt):
    out = mf(sharded, tmp_path / "mf", recipe, format=fmt)
    q = lowbit.quantize(copy.deepcopy(model), recipe)
    ref = lowbit.save(q, tmp_path / "ref", format=fmt)
    assert_same_tensors(folder_tensors(out), folder_tensors(ref))
    assert _qcfg(out) == _qcfg(ref)
    groups = _qcfg(out)["config_groups"]
    assert len(groups) == 2 and sum(len(g["targets"]) for g in groups.values()) == len(q.lowbit_recipe)
    if recipe is LAYER0_FLOAT:
        assert "model.layers.0.mlp.down_proj" in _qcfg(out)["ignore"]
        assert folder_tensors(out)["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


def test_a_recipe_object_and_its_file_give_the_same_folder(sharded, tmp_path):
    path = Recipe.of(ATTN8).save(tmp_path / "r.yaml")
    a, b = mf(sharded, tmp_path / "a", Recipe.of(ATTN8)), mf(sharded, tmp_path / "b", str(path))
    assert_same_tensors(folder_tensors(a), folder_tensors(b))
    assert _qcfg(a) == _qcfg(b)


def test_a_uniform_recipe_is_the_plain_scheme(sharded, tmp_path):
    a, b = mf(sharded, tmp_path / "a", {"Linear": "w4a16"}), mf(sharded, tmp_path / "b", "w4a16")
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {p.name: p.read_bytes() for p in b.iterdir()}


def test_bad_recipes_write_nothing(sharded, tmp_path):
    with pytest.raises(RecipeError, match=r"'re:.*nope' matches no quantizable linear"):
        mf(sharded, tmp_path / "a", {r"re:.*nope": "w8a16", "default": "w4a16"})
    assert no_output(tmp_path / "a")
    with pytest.raises(SchemeError, match="scheme 'w8a8-fp8' needs calibration"):
        mf(sharded, tmp_path / "b", {r"re:.*down_proj": "w8a8-fp8", "default": "w4a16"})
    assert no_output(tmp_path / "b")
    with pytest.raises(RecipeError, match="splits modules"):
        mf(sharded, tmp_path / "c", {r"re:.*q_proj": "w8a16", "default": "w4a16"})
    assert no_output(tmp_path / "c")


def test_the_recipe_is_in_the_fingerprint_and_the_agreed_arguments(sharded, tmp_path):
    from lowbit.modelfree.run import _fingerprint, _run_arguments
    from lowbit.modelfree.options import RunOptions
    from lowbit.modelfree.source import Checkpoint
    from lowbit.formats import Format
    from lowbit.recipes.plan import recipe_key
    from lowbit.schemes import get_scheme

    ck = Checkpoint(sharded)
    keys = [recipe_key(Recipe.of(r)) for r in (ATTN8, FP8_DOWN, "w4a16")]
    fps = {_fingerprint(ck, k, "lowbit", [], False, 1 << 27) for k in keys}
    assert len(fps) == 3
    assert keys[2] == get_scheme("w4a16").to_dict()  # one scheme: what it was before recipes
    args = [_run_arguments(sharded, tmp_path, Recipe.of(r), Format.LOWBIT, [], False, True, False, None, RunOptions())
            for r in (ATTN8, FP8_DOWN)]
    assert args[0]["scheme"] != args[1]["scheme"]
    # an interrupted run of another recipe is not resumed: the output is this recipe's
    out = tmp_path / "out"
    tmp = tmp_path / ".out.lowbit-tmp"
    (tmp / ".modelfree").mkdir(parents=True)
    (tmp / ".modelfree" / "run.json").write_text(json.dumps({"fingerprint": fps.pop()}))
    mf(sharded, out, ATTN8)
    ref = mf(sharded, tmp_path / "ref", ATTN8, resume=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in ref.iterdir()}



def _two_surveys(ckpt, r):
    """The plan as plan_recipe made it before it surveyed once: the names from one survey, then
    a second with the modules the recipe leaves in float ignored by exact name."""
    import re

    from lowbit.modelfree.plan import make_plan
    from lowbit.moe.naming import model_names
    from lowbit.recipes import Assignment
    from lowbit.recipes.plan import plan as resolve

    found = make_plan(ckpt, None).quantized
    as_model = model_names(ckpt.get("model_type"), found)
    chosen = resolve(r, [as_model[n] for n in found])
    disk = {as_model[n]: n for n in found}
    if chosen.uniform is not None:
        return make_plan(ckpt, Assignment.for_all(chosen.uniform, r))
    one = chosen.distinct[0] if len(chosen.distinct) == 1 else None
    assign = Assignment.for_all(one, r) if one is not None else Assignment({disk[n]: s for n, s in chosen.items()},
                                                                           (), r)
    return make_plan(ckpt, assign, [re.escape(disk[n]) for n in chosen.left])


def _surveyed_once(folder, recipe, monkeypatch):
    """plan_recipe's plan, checking that it surveyed the checkpoint once (set_apart is asked once
    per survey) and that the plan equals the two surveys'."""
    from lowbit.modelfree import plan as plan_mod
    from lowbit.modelfree.mixed import plan_recipe
    from lowbit.modelfree.source import Checkpoint

    ckpt, r = Checkpoint(folder), Recipe.of(recipe)
    calls = []
    real = plan_mod.set_apart
    monkeypatch.setattr(plan_mod, "set_apart", lambda root: calls.append(root) or real(root))
    got = plan_recipe(ckpt, r)
    assert len(calls) == 1
    monkeypatch.setattr(plan_mod, "set_apart", real)
    assert got == _two_surveys(ckpt, r)
    return got


@pytest.mark.parametrize("recipe", [ATTN8, LAYER0_FLOAT, {"Linear": "w4a16"}], ids=["attn8", "layer0-float", "plain"])
def test_a_recipe_surveys_the_checkpoint_once(sharded, recipe, monkeypatch):
    got = _surveyed_once(sharded, recipe, monkeypatch)
    assert (recipe is LAYER0_FLOAT) == ("model.layers.0.mlp.down_proj" in got.ignored)


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_experts_left_in_float_by_a_recipe_survey_once(family, tmp_path, monkeypatch):
    from helpers.moe_models import tiny_moe

    tiny_moe(family).save_pretrained(tmp_path / "m")
    recipe = {r"re:.*self_attn": "w8a8-int8-dynamic", "default": "w4a16", "ignore": [r"re:.*layers\.0\.mlp\.experts\."]}
    got = _surveyed_once(tmp_path / "m", recipe, monkeypatch)
    experts = "model.layers.0.block_sparse_moe.experts." if family == "mixtral" else "model.layers.0.mlp.experts."
    assert len([m for m in got.ignored if m.startswith(experts)]) == 8 * 3  # gpt-oss: parts of its fused tensors
    assert len(got.quantized) == 32 and not any(m.startswith(experts) for m in got.quantized)
