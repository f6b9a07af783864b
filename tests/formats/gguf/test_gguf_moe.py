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
