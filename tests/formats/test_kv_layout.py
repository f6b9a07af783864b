"""Each checkpoint format's own KV-cache rule, asked of its layout: where the FP8 KV scales go when
written (tensors in which dtype, or the config) and where they are read back from."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import FormatError
from lowbit.formats import LAYOUTS, Format, ParsedConfig, get_layout

SCALES = {"m.self_attn": (torch.tensor(0.5), torch.tensor([0.25]))}


@pytest.mark.parametrize("fmt,dtype", [(Format.LOWBIT, torch.float32), (Format.COMPRESSED_TENSORS, torch.bfloat16)])
def test_formats_with_kv_tensors_write_and_read_them(fmt, dtype):
    layout = get_layout(fmt)
    t = layout.kv_tensors(SCALES, torch.bfloat16)
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == \
        {"m.self_attn.k_scale": ((1,), dtype), "m.self_attn.v_scale": ((1,), dtype)}
    parsed = ParsedConfig(fmt, [], kv_cache="fp8")
    back = layout.read_kv_scales(parsed, t, ["m.self_attn"])
    assert [float(v) for v in back["m.self_attn"]] == [0.5, 0.25]
    with pytest.raises(FormatError, match="'m.self_attn.v_scale' is missing"):
        layout.read_kv_scales(parsed, {"m.self_attn.k_scale": t["m.self_attn.k_scale"]}, ["m.self_attn"])


def test_the_fake_format_keeps_kv_scales_in_its_config():
    layout = get_layout(Format.FAKE)
    assert layout.kv_tensors(SCALES, torch.bfloat16) == {}
    entry = layout.add_kv_config({}, "fp8", SCALES)["kv_cache"]
    assert entry["scales"] == {"m.self_attn": {"k_scale": 0.5, "v_scale": 0.25}}
    parsed = ParsedConfig(Format.FAKE, [], kv_cache="fp8", kv_scales=entry["scales"])
    back = layout.read_kv_scales(parsed, {}, ["m.self_attn"])
    assert [(float(v), v.dtype) for v in back["m.self_attn"]] == [(0.5, torch.float32), (0.25, torch.float32)]
    with pytest.raises(FormatError, match="no scales for attention module 'other'"):
        layout.read_kv_scales(parsed, {}, ["other"])


def test_config_entries_differ_by_format_and_none_without_a_kv_cache():
    assert "kv_cache_scheme" in get_layout(Format.COMPRESSED_TENSORS).add_kv_config({}, "fp8", SCALES)
    assert "scales" not in get_layout(Format.LOWBIT).add_kv_config({}, "fp8", SCALES)["kv_cache"]
    for fmt in (layout.format for layout in LAYOUTS):  # the folder formats
        assert get_layout(fmt).add_kv_config({"x": 1}, None, {}) == {"x": 1}
        assert get_layout(fmt).read_kv_scales(ParsedConfig(fmt, []), {}, ["m.self_attn"]) == {}
