"""Streamed calibrated quantization (lowbit.quantize_checkpoint with calibration) writes the
tensors and config of the in-memory path (load_model, quantize, save), bit for bit."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.folders import assert_same_tensors, folder_tensors
from helpers.models import tiny_llama
from helpers.moe_models import tiny_moe
from helpers.streamed import config_of, in_memory, write_folder

TOKENS = torch.randint(0, 256, (10, 32), generator=torch.Generator().manual_seed(0))  # 3 batches of 4


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return write_folder(tiny_llama(num_hidden_layers=3, hidden_size=128, intermediate_size=256),
                        tmp_path_factory.mktemp("streamed") / "src")


def _same(a, b) -> None:
    assert_same_tensors(folder_tensors(a), folder_tensors(b))
    assert config_of(a) == config_of(b)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("scheme,fmt,kw", [
    ("w8a8-int8", "compressed-tensors", {}),                       # SmoothQuant 0.8 + static scales
    ("nvfp4", "lowbit", {}),                                       # GPTQ (its default) + global scales
    ("w4a16", "compressed-tensors", {"weight_rounding": "gptq"}),
    ("w8a8-fp8", "fake", {"layer_inputs": "float"}),
    ("nvfp4", "lowbit", {"reconstruct_iters": 4}),                 # block reconstruction (float targets carried)
])
def test_streamed_equals_in_memory(llama_src, tmp_path, scheme, fmt, kw):
    a = in_memory(llama_src, tmp_path / "mem", scheme, fmt, TOKENS, **kw)
    b = lowbit.quantize_checkpoint(llama_src, tmp_path / "str", scheme, fmt, calibration=TOKENS, **kw)
    _same(a, b)
    shards = sorted(p.name for p in b.glob("*.safetensors"))
    assert len(shards) == 4  # one per decoder layer, one for the rest
    assert not (b / ".lowbit-stream").exists() and not (tmp_path / ".str.lowbit-tmp").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_streamed_moe_equals_in_memory(tmp_path, family):
    src = write_folder(tiny_moe(family), tmp_path / "src", shard_bytes="200KB")
    a = in_memory(src, tmp_path / "mem", "w8a8-int8", "compressed-tensors", TOKENS[:4])
    b = lowbit.quantize_checkpoint(src, tmp_path / "str", "w8a8-int8", "compressed-tensors", calibration=TOKENS[:4])
    _same(a, b)


@pytest.mark.parametrize("kw", [{}, {"reconstruct_iters": 4}])
def test_kill_then_resume_gives_the_same_bytes(llama_src, tmp_path, monkeypatch, kw):
    from lowbit.streamed.output import StreamOutput

    whole = lowbit.quantize_checkpoint(llama_src, tmp_path / "whole", "nvfp4", calibration=TOKENS, **kw)
    real = StreamOutput.write_layer

    def dies_after_two(self, i, *a, **k):
        if i == 2:
            raise KeyboardInterrupt  # the run is stopped after two layers are on disk
        return real(self, i, *a, **k)

    monkeypatch.setattr(StreamOutput, "write_layer", dies_after_two)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        lowbit.quantize_checkpoint(llama_src, out, "nvfp4", calibration=TOKENS, **kw)
    assert not out.exists() and (tmp_path / ".resumed.lowbit-tmp" / ".lowbit-stream" / "progress.json").is_file()
    monkeypatch.setattr(StreamOutput, "write_layer", real)
    seen = []
    monkeypatch.setattr(StreamOutput, "write_layer", lambda self, i, *a, **k: (seen.append(i), real(self, i, *a, **k)))
    lowbit.quantize_checkpoint(llama_src, out, "nvfp4", calibration=TOKENS, **kw)
    assert seen == [2]  # layers 0 and 1 were not computed again
    for f in sorted(whole.iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_other_arguments_start_afresh(llama_src, tmp_path, monkeypatch):
    from lowbit.streamed.output import StreamOutput

    real = StreamOutput.write_layer

    def dies(self, i, *a, **k):
        if i == 1:
            raise KeyboardInterrupt
        return real(self, i, *a, **k)

    monkeypatch.setattr(StreamOutput, "write_layer", dies)
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        lowbit.quantize_checkpoint(llama_src, out, "w8a8-int8", calibration=TOKENS)
    monkeypatch.setattr(StreamOutput, "write_layer", real)
    lowbit.quantize_checkpoint(llama_src, out, "w8a8-int8", calibration=TOKENS, smoothquant=0.5)
    ref = in_memory(llama_src, tmp_path / "mem", "w8a8-int8", "lowbit", TOKENS, smoothquant=0.5)
    assert_same_tensors(folder_tensors(out), folder_tensors(ref))


def test_refusals(llama_src, tmp_path):
    from lowbit.errors import LowbitError

    with pytest.raises(LowbitError, match="needs calibration"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "a", "w8a8-int8")
    with pytest.raises(LowbitError, match="include_lm_head"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "b", "w8a8-int8", calibration=TOKENS, include_lm_head=True)
    with pytest.raises(LowbitError, match="source"):
        lowbit.quantize_checkpoint(llama_src, llama_src, "w8a8-int8", calibration=TOKENS)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_without_calibration_it_is_model_free(llama_src, tmp_path):
    a = lowbit.quantize_checkpoint(llama_src, tmp_path / "a", "w4a16")
    b = lowbit.modelfree.quantize_model_free(llama_src, tmp_path / "b", "w4a16")
    assert_same_tensors(folder_tensors(a), folder_tensors(b))


def test_device_and_offloaded_activations_change_nothing_on_the_cpu(llama_src, tmp_path):
    """device="cpu" with offload runs every batch through the move-to-device path (what a GPU run
    does); on the CPU the numbers are the same."""
    a = lowbit.quantize_checkpoint(llama_src, tmp_path / "a", "nvfp4", calibration=TOKENS)
    b = lowbit.quantize_checkpoint(llama_src, tmp_path / "b", "nvfp4", calibration=TOKENS, device="cpu", offload=True)
    assert_same_tensors(folder_tensors(a), folder_tensors(b))


def test_distributed_refuses_what_it_cannot_combine(monkeypatch, llama_src, tmp_path):
    """Refused before any collective but the barrier the ranks meet at to refuse together (one
    rank here, no process group: the barrier is recorded)."""
    from lowbit.dist import DistError, Group

    met = []
    monkeypatch.setattr(Group, "barrier", lambda self: met.append(self.rank))
    two = Group(rank=0, world=2, distributed=True)
    with pytest.raises(DistError, match="observer"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "a", "w8a8-int8", calibration=TOKENS, observer="mse",
                                   group=two)
    assert met == [0]
    with pytest.raises(DistError, match="auto"):
        lowbit.quantize_checkpoint(llama_src, tmp_path / "b", "w8a8-int8", calibration=TOKENS, smoothquant="auto",
                                   group=two)
    assert met == [0, 0]
