"""Recipes as data: the flat and grouped mappings, JSON and YAML files, and how a recipe resolves
on a model's linear names (claims, defaults, ignore, fused siblings and MoE blocks kept whole)."""

from __future__ import annotations

import json

import pytest

from lowbit.recipes import Recipe, RecipeError, resolve
from lowbit.schemes import PRESETS

NAMES = [f"model.layers.{i}.{m}" for i in range(2) for m in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def test_flat_recipe_resolves_claims_over_the_default():
    a = resolve(Recipe.of({r"re:.*mlp\.down_proj": "w8a8-fp8", "default": "nvfp4"}), NAMES)
    assert a["model.layers.1.mlp.down_proj"] == PRESETS["w8a8-fp8"]
    assert a["model.layers.0.self_attn.q_proj"] == PRESETS["nvfp4"]
    assert a.counts() == {"nvfp4": 12, "w8a8-fp8": 2}
    assert a.left == () and a.uniform is None


def test_grouped_recipe_with_class_target_and_ignore():
    r = Recipe.of({"config_groups": {"attn": {"targets": ["re:.*self_attn"], "scheme": "w8a8-int8"},
                                     "rest": {"targets": ["Linear"], "scheme": "w4a16"}},
                   "ignore": [r"re:model\.layers\.0\.mlp"]})
    a = resolve(r, NAMES)
    assert a["model.layers.0.self_attn.o_proj"].name == "w8a8-int8"  # explicit beats the class target
    assert a["model.layers.1.mlp.up_proj"].name == "w4a16"
    assert a.left == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj")


def test_without_default_unclaimed_linears_stay_float_and_are_listed():
    a = resolve(Recipe.of({"re:.*self_attn": "w8a8-int8"}), NAMES)
    assert len(a) == 8 and len(a.left) == 6 and all(".mlp." in n for n in a.left)


def test_uniform_recipe_is_one_scheme():
    assert resolve(Recipe.of({"Linear": "nvfp4"}), NAMES).uniform == PRESETS["nvfp4"]
    assert resolve(Recipe.of("nvfp4"), NAMES).uniform == PRESETS["nvfp4"]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_to_dict_round_trips_through_files(tmp_path, suffix):
    custom = PRESETS["w4a16"].to_dict() | {"name": "w4a16-custom"}
    r = Recipe.of({r"re:.*down_proj": custom, "re:.*o_proj": "w8a8-fp8", "default": "nvfp4", "ignore": ["lm_head"]})
    path = r.save(tmp_path / f"r{suffix}")
    assert Recipe.of(path) == r and Recipe.of(str(path)) == r
    assert Recipe.of(r.to_dict()) == r
    if suffix == ".json":
        assert json.loads(path.read_text())["default"] == "nvfp4"


@pytest.mark.parametrize("recipe,needle", [
    ({"re:.*nothing_here": "nvfp4", "default": "w4a16"}, "'re:.*nothing_here' matches no quantizable linear"),
    ({"re:.*mlp": "nvfp4", "re:.*down_proj": "w8a8-fp8"}, "claimed by recipe entries 're:.*mlp' (nvfp4) and "
                                                        "'re:.*down_proj' (w8a8-fp8)"),
    ({"re:.*q_proj": "w8a8-fp8", "default": "nvfp4"}, "splits modules that engines run as one tensor"),
    ({"re:.*gate_proj": "w8a8-fp8"}, "model.layers.0.mlp.up_proj (float)"),
    ({"default": "nvfp5"}, "recipe 'default': unknown scheme 'nvfp5'"),
    ({"re:[": "nvfp4"}, "'re:[' is not a valid regular expression"),
    ({"config_groups": {"g": {"targets": ["Linear"]}}}, "group 'g' must have exactly 'targets' and 'scheme'"),
    ({"ignore": ["lm_head"]}, "needs at least one group or a 'default'"),
    ({"model.layers.0.mlp.down_proj": "w4a16", "default": "w4a16", "ignore": ["re:model.layers.0.mlp"]},
     "matches no quantizable linear of the model (all it matches is ignored)"),
])
def test_bad_recipes_name_the_entry(recipe, needle):
    with pytest.raises(RecipeError) as e:
        resolve(Recipe.of(recipe), NAMES)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_moe_experts_of_one_block_share_a_scheme():
    names = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    ok = resolve(Recipe.of({r"re:.*experts": "nvfp4", "default": "w8a8-int8"}), names)
    assert ok.counts() == {"nvfp4": 9}
    with pytest.raises(RecipeError, match="splits modules"):
        resolve(Recipe.of({r"re:.*experts\.0\.": "w8a8-fp8", "default": "nvfp4"}), names)
    with pytest.raises(RecipeError, match="splits modules"):
        resolve(Recipe.of({r"re:.*down_proj": "w8a8-fp8", "default": "nvfp4"}), names)


@pytest.mark.parametrize("text,suffix,needle", [("{not json", ".json", "is not valid JSON"),
                                               ("a: [1,\n", ".yaml", "is not valid YAML"),
                                               ("[1, 2]", ".json", "must hold a mapping")])
def test_bad_recipe_files_are_one_line_naming_the_file(tmp_path, text, suffix, needle):
    p = tmp_path / f"bad{suffix}"
    p.write_text(text)
    with pytest.raises(RecipeError) as e:
        Recipe.of(p)
    assert needle in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RecipeError, match="cannot be read"):
        Recipe.of(tmp_path / "missing.json")
