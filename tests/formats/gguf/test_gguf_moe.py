"""An MoE model's GGUF file with calibration: its experts, which the converter stacks into
[E, out, in] tensors, get an importance vector and GPTQ per expert, from the tokens routed to
each (the model's experts split into linears, matched to the checkpoint's per-expert tensors by
the family's names: Mixtral's ``block_sparse_moe.experts.{e}.w1``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_folders import save_gguf_folder, skip_without_converter
from helpers.moe_models import tiny_moe

skip_without_converter()

from lowbit.calibration import CalibrationConfig  # noqa: E402
from lowbit.calibration.importance import input_statistics  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.linearize import linearize  # noqa: E402
from lowbit.numerics.ggml import GgmlType, decode  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_gguf_folder(tiny_moe("mixtral"), tmp_path_factory.mktemp("mixtral"))


def _calib():
    return torch.randint(3, 250, (4, 64), generator=torch.Generator().manual_seed(1))


def _experts(path, name):
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    kind = GgmlType[t.tensor_type.name]
    rows = torch.from_numpy(np.array(t.data))
    return decode(rows.reshape(-1, rows.shape[-1]), kind).reshape(rows.shape[0], rows.shape[1], -1)


def _gptq_wins(model, hess, gptq_file, rtn_file, experts: str) -> tuple[int, int]:
    """(experts of block 0 whose Hessian-weighted error is lower in ``gptq_file`` than in
    ``rtn_file``, experts compared), over gate, up and down (experts no token reached skipped)."""
    wins = total = 0
    for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
        g, r = _experts(gptq_file, f"blk.0.{name}.weight"), _experts(rtn_file, f"blk.0.{name}.weight")
        for e in range(g.shape[0]):
            lin = f"{experts}.{e}.{proj}"
            if lin not in hess:
                continue  # an expert no token reached keeps the search's codes
            w = model.get_submodule(lin).weight.detach().double()
            h = hess[lin].upper().double()
            h = torch.triu(h) + torch.triu(h, 1).T
            err = [float(torch.einsum("oi,ij,oj->", w - q.double(), h, w - q.double())) for q in (g[e], r[e])]
            wins += err[0] < err[1]
            total += 1
    return wins, total


def test_experts_are_rounded_per_expert_by_gptq(folder, tmp_path):
    calib = _calib()
    gptq = quantize_gguf(folder, tmp_path / "g.gguf", "Q4_0", calibration=calib, progress=False)
    rtn = quantize_gguf(folder, tmp_path / "r.gguf", "Q4_0", calibration=calib, progress=False,
                        config=CalibrationConfig(weight_rounding="rtn"))
    assert "blk.0.ffn_gate_exps.weight" in gptq.from_encoded and "blk.1.ffn_down_exps.weight" in gptq.from_encoded
    assert not any("exps" in n for n in rtn.from_encoded)
    # each expert's output error on the tokens routed to it (its own Hessian): GPTQ's is lower
    model = tiny_moe("mixtral")
    linearize(model)
    _, hess = input_statistics(model, calib, hessians=True, unseen=1.0)
    g, r = _experts(tmp_path / "g.gguf", "blk.0.ffn_gate_exps.weight"), \
        _experts(tmp_path / "r.gguf", "blk.0.ffn_gate_exps.weight")
    wins = 0
    experts = model.model.layers[0].mlp.experts
    for e in range(g.shape[0]):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj"
        w = experts[e].gate_proj.weight.detach().double()
        h = hess[name].upper().double()
        h = torch.triu(h) + torch.triu(h, 1).T
        err = [float(torch.einsum("oi,ij,oj->", w - q.double(), h, w - q.double())) for q in (g[e], r[e])]
        wins += err[0] < err[1]
    assert wins == g.shape[0], wins


def test_experts_stored_fused_are_rounded_per_expert_and_stacked(tmp_path):
    """GraniteMoE keeps each block's experts in one tensor (``block_sparse_moe.input_linear``
    [E, 2I, H], gate rows then up rows): each expert is rounded by GPTQ on its own tokens' Hessian
    as a split linear, and the rows are stacked back in the fused tensor's order
    (``lowbit.gguf_fused``); every expert's output error is below the search's own codes'."""
    from helpers.families import tiny_model

    folder = save_gguf_folder(tiny_model("granitemoe"), tmp_path / "granite")
    calib = _calib()
    gptq = quantize_gguf(folder, tmp_path / "g.gguf", "Q4_0", calibration=calib, progress=False)
    rtn = quantize_gguf(folder, tmp_path / "r.gguf", "Q4_0", calibration=calib, progress=False,
                        config=CalibrationConfig(weight_rounding="rtn"))
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"} <= \
        set(gptq.from_encoded)
    assert not any("exps" in n for n in rtn.from_encoded)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    linearize(model)
    _, hess = input_statistics(model, calib, hessians=True, unseen=1.0)
    wins, total = _gptq_wins(model, hess, tmp_path / "g.gguf", tmp_path / "r.gguf",
                             "model.layers.0.block_sparse_moe.experts")
    assert total >= 6 and wins == total, (wins, total)


def test_experts_stored_transposed_and_interleaved_are_stacked_in_the_files_order(tmp_path):
    """gpt-oss keeps ``experts.gate_up_proj`` [E, H, 2I] (transposed, gate and up interleaved) and
    ``down_proj`` [E, I, H]: the plan reads them transposed (``RowMap.transposed``), and the GPTQ
    rows of each split expert land in the rows the converter writes (tensors only: the tiny
    folder has no tokenizer llama.cpp's converter reads for gpt-oss)."""
    from helpers.families import tiny_model
    from lowbit.formats import Format, get_format
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.gguf_gptq import source_types
    from lowbit.gguf_quantize import _calibrated, _in_memory
    from lowbit.gguf_streamed import Spill
    from lowbit.files.folder import SafetensorsFolder
    from lowbit.numerics.ggml import ImportanceSearch

    tiny_model("gpt_oss").save_pretrained(tmp_path / "oss")
    folder = tmp_path / "oss"
    plan = plan_gguf(folder, metadata=False)
    fmt = get_format(Format.GGUF)
    types = fmt.tensor_types(plan, GgmlType.Q4_0, True)
    calib = _calib()
    files = {}
    for rounding in ("gptq", "rtn"):
        kinds = source_types(plan, types) if rounding == "gptq" else {}
        cfg = CalibrationConfig(num_samples=4, seq_len=64, weight_rounding=rounding)
        spill = Spill.beside(tmp_path / f"{rounding}.gguf")
        imp, enc = _calibrated(folder, plan, calib, cfg, kinds, ImportanceSearch.DIRECT, spill, None, False, {})
        assert enc is spill  # one decoder layer at a time (lowbit.gguf_streamed)
        assert imp["model.layers.0.mlp.experts.gate_up_proj"].dim() == 2  # [E, H]: one vector per expert
        files[rounding] = fmt.write(plan, tmp_path / f"{rounding}.gguf", SafetensorsFolder(folder), GgmlType.Q4_0,
                                    types, importance=imp, encoded=enc, search=ImportanceSearch.DIRECT)
        # the whole model in memory gives the same vectors and rows
        imp_mem, enc_mem = _in_memory(folder, plan, calib, cfg, kinds, ImportanceSearch.DIRECT)
        assert imp_mem.keys() == imp.keys() and all(torch.equal(imp_mem[k], imp[k]) for k in imp)
        assert enc_mem.keys() == set(enc) and all(torch.equal(enc_mem[k][1], enc[k][1]) for k in enc)
        spill.close()
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"} <= \
        set(files["gptq"].from_encoded)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    linearize(model)
    _, hess = input_statistics(model, calib, hessians=True, unseen=1.0)
    wins, total = _gptq_wins(model, hess, tmp_path / "gptq.gguf", tmp_path / "rtn.gguf", "model.layers.0.mlp.experts")
    assert total >= 6 and wins == total, (wins, total)



def test_fused_experts_in_memory_get_quantize_ggufs_per_expert_rows(tmp_path):
    """transformers 5 holds Qwen3-MoE's experts fused in memory ([E, 2I, H], per expert on disk):
    ``lowbit.quantize(model, GgmlType.Q4_0, calibration)`` splits them for the statistics
    (``gguf_fused.experts_split``), so each expert gets its own importance vector and GPTQ rows,
    stacked onto the fused tensor: the rows ``quantize_gguf``'s calibration gives the checkpoint's
    per-expert tensors, gate rows then up rows; the model keeps its fused experts."""
    from transformers import AutoModelForCausalLM

    import lowbit
    from helpers.families import tiny_model
    from lowbit.formats import Format, get_format
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.gguf_gptq import source_types
    from lowbit.gguf_quantize import _in_memory
    from lowbit.numerics.ggml import ImportanceSearch

    folder = tmp_path / "qwen"
    tiny_model("qwen3_moe").save_pretrained(folder)
    calib = _calib()
    cfg = CalibrationConfig(num_samples=4, seq_len=64, batch_size=2)
    plan = plan_gguf(folder, metadata=False)
    kinds = source_types(plan, get_format(Format.GGUF).tensor_types(plan, GgmlType.Q4_0, True))
    imp_disk, enc_disk = _in_memory(folder, plan, calib, cfg, kinds, ImportanceSearch.DIRECT)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fused = {k for k, v in model.state_dict().items() if v.dim() == 3}
    lowbit.quantize(model, GgmlType.Q4_0, calib, config=cfg)
    assert fused and fused <= set(model.state_dict())  # put back as they were
    got = model.lowbit_gguf_calibrated
    key = "model.layers.0.mlp.experts.gate_up_proj"
    kind, rows = got.encoded[key]
    n_exp = rows.shape[0]
    per = enc_disk["model.layers.0.mlp.experts.0.gate_proj.weight"][1].shape[0]
    for e in range(n_exp):
        gate = enc_disk[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
        up = enc_disk[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        assert kind is gate[0] is GgmlType.Q4_0
        assert torch.equal(rows[e, :per], gate[1]) and torch.equal(rows[e, per:], up[1]), e
        assert torch.equal(got.importance[key][e], imp_disk[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"])
    down = got.encoded["model.layers.1.mlp.experts.down_proj"][1]
    assert torch.equal(down[n_exp - 1], enc_disk[f"model.layers.1.mlp.experts.{n_exp - 1}.down_proj.weight"][1])
