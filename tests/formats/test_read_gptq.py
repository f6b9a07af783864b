"""Reading auto-round's GPTQ packing (``packing_format: "auto_round:auto_gptq"``). The folders are
packed here by hand from the documented layout (lowbit.formats.gptq_pack): qweight int32
[in_p / per, out] low bits first along the input, codes u = q + 2^(bits-1); scales [groups, out];
qzeros int32 holding z - 1 packed along out; the input padded with zero weights to whole groups."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.errors import FormatError
from lowbit.formats import parse_quantization_config
from lowbit.checkpoint.inspect import inspect_checkpoint
from lowbit.model_quant import every_linear, quantize_rtn
from lowbit.numerics import get_format
from lowbit.kernels.bitpack import unpack_int32
from lowbit.schemes import PRESETS, WeightObserver, QuantSpec, Scheme
from helpers.formats_support import float_tensors, llama_config, logits, quant_layers, write_folder

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))


def _pack_rows(u: torch.Tensor, bits: int) -> torch.Tensor:
    """unsigned codes [R, C] (R a multiple of 32/bits) -> int32 [R / per, C], first row in the low bits."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    w = (u.to(torch.int64).reshape(-1, per, u.shape[1]) << shifts[None, :, None]).sum(1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def gptq_tensors(prefix: str, qt, group: int, scale_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One layer in auto_gptq packing, from a lowbit QuantizedTensor."""
    bits = qt.spec.bits
    per, half = 32 // bits, 1 << (bits - 1)
    out_f, in_f = qt.shape
    g = group if group > 0 else in_f
    in_p = -(-in_f // g) * g
    q = get_format(qt.spec.format).codes_to_int(qt.codes).to(torch.int64)
    z = torch.full_like(qt.scale, half, dtype=torch.int64) if qt.zero_point is None else \
        qt.zero_point.to(torch.int64) + half                                 # [out, groups]
    u = torch.cat([q + half, z.repeat_interleave(g, dim=1)[:, in_f:in_p]], dim=1)  # padding: zero weights
    zs = z - 1
    zs = torch.cat([zs, torch.zeros(-out_f % per, zs.shape[1], dtype=torch.int64)], dim=0)
    return {f"{prefix}.qweight": _pack_rows(u.t(), bits),
            f"{prefix}.scales": qt.scale.t().contiguous().to(scale_dtype),
            f"{prefix}.qzeros": _pack_rows(zs, bits).t().contiguous()}


def _config(**fields) -> dict:
    return llama_config(quantization_config={"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
                                             "data_type": "int", "iters": 0, "model_free": True,
                                             "block_name_to_quantize": "model.layers", **fields})


def _folder(tmp_path, scheme: Scheme, group: int, edit=None, **fields):
    """(reference model quantized by lowbit, folder with its layers packed as auto_gptq)."""
    ref = tiny_llama()
    quantize_rtn(ref, every_linear(ref, scheme))
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors.update(gptq_tensors(n, m.weight_qtensor(), group))
    if edit is not None:
        edit(tensors)
    return ref, write_folder(tmp_path / "ar", _config(**fields), tensors, shards=2)


def test_unpack_words_low_bits_first():
    """GPTQ words, read with the shared unpack_int32 (signed: the stored unsigned code - 2^(bits-1)),
    along rows (qweight, transposed first) and along columns (qzeros)."""
    w = torch.tensor([[0x76543210, -0x01234568]], dtype=torch.int32)  # -0x01234568 = 0xFEDCBA98
    assert (unpack_int32(w.t().contiguous(), 4, 8) + 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7],
                                                                     [8, 9, 10, 11, 12, 13, 14, 15]]
    assert (unpack_int32(w, 4, 16) + 8).tolist() == [list(range(16))]
    assert (unpack_int32(torch.tensor([[-1, 0x7F80FF01]], dtype=torch.int32), 8, 8) + 128).tolist() == \
        [[255, 255, 255, 255, 1, 255, 128, 127]]
    assert (unpack_int32(torch.tensor([[-0x6AAAAAAB]], dtype=torch.int32), 2, 16) + 2).tolist() == \
        [[1] * 15 + [2]]  # 0x95555555


def test_w4a16_reads_as_lowbit_w4a16_bit_for_bit(tmp_path):
    """Group 128 over inputs of 64 (q/k/v/o, gate/up: one half-padded group) and 128 (down_proj)."""
    ref, folder = _folder(tmp_path, PRESETS["w4a16"], 128, bits=4, group_size=128, sym=True)
    loaded = lowbit.load(folder, backend="reference")
    a, b = quant_layers(ref), quant_layers(loaded)
    assert list(a) == list(b) and len(b) == 14
    negative = 0
    for n in a:
        assert b[n].scheme is PRESETS["w4a16"], n
        assert b[n].weight_qtensor().equal(a[n].weight_qtensor()), n
        negative += int((b[n].weight_scale < 0).sum())
        assert int(get_format("int4").codes_to_int(b[n].weight_codes).min()) == -8
    assert negative > 0  # full-range scales: negative where the group's extreme is positive
    assert torch.equal(logits(loaded, IDS), logits(ref, IDS))
    assert not isinstance(loaded.lm_head, type(b[n]))
    rep = inspect_checkpoint(folder)
    assert rep["inconsistencies"] == [] and set(rep["layers"].values()) == {"w4a16"}


def test_w8a16_group_128_is_built_from_the_config(tmp_path):
    """auto-round's W8A16 is group 128 (lowbit's w8a16 preset is per channel): the config decides."""
    scheme = Scheme("auto-round-int-w8", QuantSpec("int8", "group", 128, observer=WeightObserver.FULL_RANGE), None)
    ref, folder = _folder(tmp_path, scheme, 128, bits=8, group_size=128, sym=True,
                          extra_config={"lm_head": {"bits": 16, "data_type": "float"}})
    loaded = lowbit.load(folder, backend="reference")
    for n, m in quant_layers(loaded).items():
        assert m.scheme == scheme and m.scheme.weights.group_size == 128
        assert m.weight_qtensor().equal(quant_layers(ref)[n].weight_qtensor()), n
        assert int(get_format("int8").codes_to_int(m.weight_codes).min()) == -128
    assert torch.equal(logits(loaded, IDS), logits(ref, IDS))


def test_per_channel_group_minus_one(tmp_path):
    scheme = Scheme("auto-round-int-w4", QuantSpec("int4", "channel", observer=WeightObserver.FULL_RANGE), None)
    ref, folder = _folder(tmp_path, scheme, -1, bits=4, group_size=-1, sym=True)
    loaded = lowbit.load(folder, backend="reference")
    for n, m in quant_layers(loaded).items():
        assert m.scheme == scheme and m.weight_qtensor().equal(quant_layers(ref)[n].weight_qtensor()), n
    assert torch.equal(logits(loaded, IDS), logits(ref, IDS))


def test_asymmetric_zero_points(tmp_path):
    scheme = Scheme("auto-round-int-w4", QuantSpec("int4", "group", 32, symmetric=False), None)
    ref, folder = _folder(tmp_path, scheme, 32, bits=4, group_size=32, sym=False)
    loaded = lowbit.load(folder, backend="reference")
    zps = []
    for n, m in quant_layers(loaded).items():
        assert m.scheme == scheme and m.weight_qtensor().equal(quant_layers(ref)[n].weight_qtensor()), n
        zps.append(m.weight_qtensor().zero_point.flatten())
    zps = torch.cat(zps)
    assert int(zps.min()) < 0 < int(zps.max())  # real zero points, both signs
    assert torch.equal(logits(loaded, IDS), logits(ref, IDS))


def test_trivial_g_idx_is_accepted_and_fp16_scales_read_exactly(tmp_path):
    def edit(t):
        for k in [k for k in t if k.endswith(".qweight")]:
            p = k.removesuffix(".qweight")
            in_f = 128 if p.endswith("down_proj") else 64
            t[f"{p}.g_idx"] = torch.arange(in_f if p.endswith("q_proj") else 128, dtype=torch.int32) // 128
            t[f"{p}.scales"] = t[f"{p}.scales"].to(torch.float16)
    ref, folder = _folder(tmp_path, PRESETS["w4a16"], 128, edit, bits=4, group_size=128)
    loaded = lowbit.load(folder, backend="reference")
    m, r = loaded.model.layers[0].self_attn.q_proj, ref.model.layers[0].self_attn.q_proj
    assert torch.equal(m.weight_codes, r.weight_codes)
    assert torch.equal(m.weight_scale, r.weight_scale.to(torch.float16).float())


@pytest.mark.parametrize("case", ["qweight_shape", "scales_shape", "g_idx_act_order", "sym_zeros", "zero_wrap",
                                  "padding", "qweight_dtype"])
def test_bad_tensors_are_named(tmp_path, case):
    p = "model.layers.1.self_attn.k_proj"
    asym = case == "zero_wrap"

    def edit(t):
        if case == "qweight_shape":
            t[f"{p}.qweight"] = t[f"{p}.qweight"][:-1]
        elif case == "scales_shape":
            t[f"{p}.scales"] = t[f"{p}.scales"][:, :-1]
        elif case == "g_idx_act_order":
            g = torch.arange(64, dtype=torch.int32) // 32
            t[f"{p}.g_idx"] = g.flip(0)
        elif case == "sym_zeros":
            t[f"{p}.qzeros"] = t[f"{p}.qzeros"] + 1  # stored 8: zero point 9
        elif case == "zero_wrap":
            t[f"{p}.qzeros"][0, 0] |= 0xF  # stored 15: zero point 16
        elif case == "padding":
            t[f"{p}.qweight"][-1, 0] ^= 1  # a padded input (64..127) now holds a nonzero weight
        elif case == "qweight_dtype":
            t[f"{p}.qweight"] = t[f"{p}.qweight"].to(torch.int64)
    group = 32 if case in ("g_idx_act_order", "zero_wrap") else 128
    scheme = Scheme("s", QuantSpec("int4", "group", group, symmetric=not asym,
                                   observer=WeightObserver.MAX if asym else WeightObserver.FULL_RANGE), None)
    _, folder = _folder(tmp_path, scheme, group, edit, bits=4, group_size=group, sym=not asym)
    msg = {"qweight_shape": r"qweight.*shape \(15, 32\), expected \(16, 32\)",
           "scales_shape": r"scales.*shape \(1, 31\), expected \(1, 32\)",
           "g_idx_act_order": r"g_idx.*act-order", "sym_zeros": r"qzeros.*zero point 9 .*symmetric",
           "zero_wrap": r"qzeros.*zero point 16", "padding": r"qweight.*padded inputs 64\.\.127",
           "qweight_dtype": r"qweight.*dtype torch.int64"}[case]
    with pytest.raises(FormatError, match=msg) as e:
        lowbit.load(folder, backend="reference")
    assert p in str(e.value)


@pytest.mark.parametrize("fields, msg", [
    ({"bits": 3}, "3 bits"),
    ({"bits": 4, "act_bits": 8}, "weight-only"),
    ({"bits": 4, "data_type": "mx_fp"}, "INT weights only"),
    ({"bits": 4, "group_size": 0}, "per channel"),
])
def test_unsupported_gptq_configs_are_refused(fields, msg):
    qcfg = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", **fields}
    with pytest.raises(FormatError, match=msg):
        parse_quantization_config({"quantization_config": qcfg})
