"""Model-free quantization and torchrun on a sample of the new families: a hybrid (Nemotron-H:
Mamba-2, attention and MoE layers, a checkpoint transformers renames), an MoE with linear
attention (Qwen3.5-MoE), Gemma 4 (a linear outside the decoder layers), Qwen3-Next, Granite (experts
fused on disk under a name transformers renames)."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit
from helpers.families import tiny_model
from helpers.modelfree import digests, mf
from helpers.streamed import write_folder

IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _src(model_type: str, path, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return write_folder(tiny_model(model_type), path, dtype=dtype)


@pytest.mark.parametrize("model_type,scheme", [("nemotron_h", "w8a16"), ("nemotron_h", "w8a8-fp8-dynamic"),
                                               ("qwen3_5_moe_text", "w8a8-fp8-dynamic"), ("gemma4_text", "w8a16"),
                                               ("qwen3_next", "w8a16"), ("granitemoehybrid", "w8a16"),
                                               ("granitemoe", "w8a8-fp8-dynamic"),
                                               # dt_proj is read as dt_proj.weight: in float, as in memory
                                               ("mamba", "w8a16"), ("falcon_mamba", "w8a16")])
def test_model_free_computes_what_in_memory_computes(model_type, scheme, tmp_path):
    """The model-free folder loads to the logits of the in-memory model. Nemotron-H's keeps the
    checkpoint's ``backbone.`` names, which lowbit.load reads through transformers' renames;
    Granite's experts are stored fused as ``block_sparse_moe.input_linear.weight`` [E, 2I, H] and
    its router as ``router.layer``, names transformers renames to ``experts.gate_up_proj`` and
    ``router``: split by the layout of the experts module transformers builds (lowbit.moe.layouts),
    the router kept in float."""
    src = _src(model_type, tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = lowbit.load_model(src)
        q = lowbit.quantize(model, scheme)
        back = lowbit.load(mf(src, tmp_path / "mf", scheme))
        with torch.no_grad():
            ref, got = q(input_ids=IDS, use_cache=False).logits, back(input_ids=IDS, use_cache=False).logits
    assert sum(hasattr(m, "weight_codes") for m in back.modules()) == sum(hasattr(m, "weight_codes") for m in q.modules())
    assert torch.equal(got, ref)


def test_model_free_keeps_the_linears_the_forward_sets_apart_in_float(tmp_path):
    """Mamba's dt_proj is read by its weight, not called: the forward of the model built from
    config.json on the meta device says so, as the in-memory forward does (lowbit.modelfree.meta_survey)."""
    from lowbit.modelfree.meta_survey import set_apart

    src = _src("mamba", tmp_path / "src")
    assert set_apart(src) == ("backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = lowbit.load(mf(src, tmp_path / "mf", "w8a16"))
    assert type(back.get_submodule("backbone.layers.1.mixer.dt_proj")) is torch.nn.Linear
    assert type(back.get_submodule("backbone.layers.1.mixer.x_proj")).__name__ == "QuantLinear"


def test_model_free_splits_a_linear_applied_per_head_group_as_in_memory(tmp_path):
    """DeepSeek-V4's ``o_a_proj`` (stored ``attn.wo_a.weight``: row block g applied to head group g)
    is quantized per group, ``attn.wo_a.{g}``, from row blocks of the stored weight: the tensors
    the in-memory save writes, and the folder loads to the in-memory model's logits. Its head is
    stored as ``head.weight`` (transformers loads it as ``lm_head``): a head, kept in float and
    listed, not taken for an embedding. (The tiny config says bfloat16 over float32 tensors: the
    model-free folder is loaded in float32, as the in-memory model is.)"""
    from helpers.folders import folder_tensors

    src = _src("deepseek_v4", tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = lowbit.load_model(src)
        q = lowbit.quantize(model, "w8a16")
        mem = folder_tensors(lowbit.save(q, tmp_path / "mem"))
        out = mf(src, tmp_path / "mf", "w8a16")
        back = lowbit.load(out, dtype=torch.float32)
        with torch.no_grad():
            ref, got = q(input_ids=IDS, use_cache=False).logits, back(input_ids=IDS, use_cache=False).logits
    free = folder_tensors(out)
    groups = sorted(k for k in free if ".wo_a." in k)
    assert len(groups) == 2 * 8 * 2  # 2 layers x 8 groups x (codes, scale)
    assert "model.layers.1.attn.wo_a.7.weight_codes" in groups and "model.layers.1.attn.wo_a.weight" not in free
    assert all(torch.equal(free[k], mem[k]) for k in groups)
    assert torch.equal(got, ref)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("model_type", ["nemotron_h", "qwen3_5_moe_text", "gemma4_text"])
def test_two_ranks_write_what_one_process_writes(model_type, tmp_path):
    """Streamed calibrated (static INT8 with SmoothQuant; NVFP4 with GPTQ) and model-free, under
    torchrun with 2 ranks: the same bytes as one process."""
    from streamed.test_streamed_dist import _run
    from helpers.streamed_job import out_name

    src = _src(model_type, tmp_path / "src", torch.bfloat16)
    jobs = ["w8a8-int8:compressed-tensors", "nvfp4:lowbit", "w8a16:lowbit:modelfree"]
    _run([str(src), str(tmp_path / "one"), *jobs], 1)
    _run([str(src), str(tmp_path / "two"), *jobs], 2)
    for job in jobs:
        one, two = digests(tmp_path / "one" / out_name(job)), digests(tmp_path / "two" / out_name(job))
        assert one == two, job
