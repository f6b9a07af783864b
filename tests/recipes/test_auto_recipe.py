"""The automatic choice: effective bits counted with scales, the knapsack meets the budget with the
least score, sensitivities rank a damaged linear first, and auto_recipe's recipe quantizes."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.recipes import RecipeError
from lowbit.recipes.weight_bits import average_bits, weight_bits
from lowbit.recipes.choose import Option, choose
from lowbit.schemes import PRESETS

CALIB = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(3))
DIMS = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256}


@pytest.mark.parametrize("scheme,bits", [("nvfp4", 4.5), ("nvfp4-e5m3", 4.5), ("mxfp4", 4.25), ("w4a16", 4.125),
                                         ("w4a16-asym", 4.15625), ("w8a8-fp8", 8 + 16 / 512), ("fp8-block", 8 + 8 / 128 ** 2 * 1),
                                         ("w8a8-int8", 8 + 16 / 512)])
def test_effective_bits_count_scales(scheme, bits):
    got = weight_bits(PRESETS[scheme], 256, 512) / (256 * 512)
    if scheme == "fp8-block":  # 2 x 4 tiles of 128 x 128, fp32 scales counted as 16 bits
        bits = 8 + 8 * 16 / (256 * 512)
    assert got == pytest.approx(bits, abs=1e-12)


def test_choose_meets_the_budget_with_the_least_score():
    import itertools

    opts = [[Option(4, 10.0), Option(8, 1.0)], [Option(4, 3.0), Option(8, 2.5)], [Option(4, 7.0), Option(8, 0.5)],
            [Option(4, 1.0), Option(6, 0.9), Option(8, 0.0)]]
    for budget in range(16, 33):
        got = choose(opts, budget, 1)
        feasible = [p for p in itertools.product(*[range(len(o)) for o in opts])
                    if sum(o[k].bits for o, k in zip(opts, p)) <= budget]
        best = min(sum(o[k].score for o, k in zip(opts, p)) for p in feasible)
        assert sum(o[k].bits for o, k in zip(opts, got)) <= budget
        assert sum(o[k].score for o, k in zip(opts, got)) == pytest.approx(best), budget
    with pytest.raises(RecipeError, match="no mix of the candidates meets 15 average bits: they reach 16 to 32"):
        choose(opts, 15, 1)


def test_sensitivity_is_the_fisher_weighted_output_error():
    """S for one linear equals the mean over windows of N * sum((dL/dy * (y_q - y))^2), N the
    window's target count, computed by hand with autograd."""
    import torch.nn.functional as F

    from lowbit.quant.input_scales import qdq_activation
    from lowbit.recipes.rounded import quantized_weights
    from lowbit.recipes.sensitivity import sensitivities

    m = tiny_llama(**DIMS)
    name = "model.layers.1.mlp.down_proj"
    cands = [PRESETS["nvfp4"], PRESETS["w8a8-fp8"]]
    got = sensitivities(m, [name, "model.layers.0.self_attn.o_proj"], cands, CALIB[:2])
    lin = m.get_submodule(name)
    want = {c.name: 0.0 for c in cands}
    with torch.enable_grad():  # other test modules turn autograd off at import
        for i in range(2):
            seen = {}
            h = lin.register_forward_hook(lambda mod, a, y: seen.update(x=a[0].detach(), y=y) or y.retain_grad())
            ids = CALIB[i:i + 1]
            logits = m(input_ids=ids).logits[:, :-1]
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
            h.remove()
            g, x, y = seen["y"].grad, seen["x"], seen["y"].detach()
            for c in cands:
                wq = quantized_weights(m, [name], c)[name]
                yq = F.linear(qdq_activation(x, c.input_activations, x.abs().amax()), wq)
                want[c.name] += (ids.shape[1] - 1) * float(((yq - y) * g).pow(2).sum())
            m.zero_grad()

    for c in cands:
        assert got[name][c.name] == pytest.approx(want[c.name] / 2, rel=1e-5)
        assert got[name][c.name] > 0
    assert got[name]["w8a8-fp8"] < got[name]["nvfp4"]  # 8 bits lose less


@pytest.mark.parametrize("target", [4.5, 5.5, 6.5, 9.0])
def test_auto_recipe_meets_the_budget_and_quantizes(target):
    m = tiny_llama(**DIMS)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = lowbit.auto_recipe(m, "nvfp4,mxfp4,w8a8-fp8", target, CALIB, num_samples=2, seq_len=64)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # the float model is unchanged
    assert r.average_bits <= target
    shapes = {n: tuple(m.get_submodule(n).weight.shape) for u in r.units for n in u["names"]}
    schemes = {n: PRESETS[u["scheme"]] for u in r.units for n in u["names"]}
    assert average_bits(shapes, schemes) == pytest.approx(r.average_bits)
    if target >= 8.0625:
        assert r.counts() == {"w8a8-fp8": 14}
    q = lowbit.quantize(m, r.recipe, calibration=CALIB, num_samples=2, seq_len=64, reconstruct_iters=0)
    got = {n: mod.scheme.name for n, mod in q.named_modules() if hasattr(mod, "weight_codes")}
    assert got == {n: s.name for n, s in schemes.items()}


def test_auto_recipe_bad_input():
    m = tiny_llama(**DIMS)
    with pytest.raises(RecipeError, match=r"meets 4 average bits: they reach 4.5 to 8.11"):
        lowbit.auto_recipe(m, "nvfp4,w8a8-fp8", 4.0, CALIB)
    with pytest.raises(RecipeError, match="given twice"):
        lowbit.auto_recipe(m, "nvfp4,nvfp4", 5, CALIB)
    with pytest.raises(lowbit.errors.SchemeError, match="unknown scheme 'nvfp9'"):
        lowbit.auto_recipe(m, "nvfp4,nvfp9", 5, CALIB)


def test_padded_windows_count_only_their_real_positions():
    """S on right-padded windows under their mask equals the mean of S on each window cut to its
    real length (S is a per-token figure)."""
    from lowbit.recipes.sensitivity import sensitivities

    m = tiny_llama(**DIMS)
    names = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    cands = [PRESETS["nvfp4"], PRESETS["w8a8-int8"]]  # w8a8-int8: a static amax, which must skip padding
    lengths = [64, 40, 23]
    ids = CALIB[:3].clone()
    valid = torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]
    ids[~valid] = 255  # padding that would raise the amax and the loss if it counted
    got = sensitivities(m, names, cands, ids, valid=valid)
    want = {n: {c.name: 0.0 for c in cands} for n in names}
    for i, n_real in enumerate(lengths):
        one = sensitivities(m, names, cands, ids[i:i + 1, :n_real])
        for n in names:
            for c in cands:
                want[n][c.name] += one[n][c.name] / len(lengths)
    for n in names:
        for c in cands:
            assert got[n][c.name] == pytest.approx(want[n][c.name], rel=1e-4)
    twice = sensitivities(m, names, cands, torch.cat([ids[:1], ids[:1]]), valid=torch.cat([valid[:1], valid[:1]]))
    for n in names:  # the same window twice: the same per-token figure as once
        assert twice[n]["nvfp4"] == pytest.approx(sensitivities(m, names, cands, ids[:1])[n]["nvfp4"], rel=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        sensitivities(m, names, cands, ids, valid=valid[:, :10])


def test_auto_recipe_measures_on_the_windows_and_masks_quantize_calibrates_on(tmp_path, monkeypatch):
    """Unpacked conversations under a template file: the sensitivity pass gets evenly spaced
    windows of the very set (ids and padding mask) lowbit.quantize calibrates on."""
    import json

    import lowbit.recipes.sensitivity as sens_mod
    from helpers.eval_fixtures import byte_tokenizer
    from lowbit.calibration import CalibrationConfig, calibration_set
    from lowbit.calibration.windows import spaced

    tok = byte_tokenizer()
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"item {i}?" + " more" * (i % 5)},
                                                       {"role": "assistant", "content": f"it has {i} parts."}]}) + "\n"
                             for i in range(10)), encoding="utf-8")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    options = dict(pack=False, chat_template=str(template), num_samples=8, seq_len=48)
    seen = []
    real = sens_mod.sensitivities
    monkeypatch.setattr(sens_mod, "sensitivities",
                        lambda *a, **k: seen.append((a[3], k.get("valid"))) or real(*a, **k))
    m = tiny_llama(**DIMS)
    r = lowbit.auto_recipe(m, "w4a16,w8a16", 6, str(chats), tokenizer=tok, **options)
    data = calibration_set(str(chats), tok, **CalibrationConfig(**options).data_options())
    keep = spaced(8, 4)
    (ids, valid), = seen
    assert data.valid is not None and not bool(data.valid.all())  # padded: the mask matters
    assert torch.equal(ids, data.ids[keep]) and torch.equal(valid, data.valid[keep])
    assert r.windows == keep.tolist() and r.calibration == data.info.as_dict()
    assert (r.calibration["packing"], r.calibration["chat_template"]) == ("padded", str(template))
    q = lowbit.quantize(m, r.recipe, calibration=str(chats), tokenizer=tok, reconstruct_iters=0, **options)
    assert q.lowbit_calibration.data == r.calibration


def test_auto_recipe_bad_sensitivity_samples():
    with pytest.raises(RecipeError, match="sensitivity_samples must be a positive number of windows"):
        lowbit.auto_recipe(tiny_llama(**DIMS), "nvfp4,w8a8-fp8", 6, CALIB, sensitivity_samples=0)
