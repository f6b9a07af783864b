"""Model-free quantization (lowbit.quantize_checkpoint) against the in-memory path, on sharded
checkpoints the tests write: same tensors bit for bit, same logits, bad input refused cleanly."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lowbit
from helpers.modelfree import mf, no_output
from lowbit.modelfree import RunOptions
from helpers.folders import assert_same_tensors, folder_tensors
from helpers.models import tiny_llama
from lowbit.errors import FormatError, QuantizationError, SchemeError

SCHEMES = ["w4a16", "w8a16", "nvfp4a16", "w8a8-int8-dynamic", "w8a8-fp8-dynamic", "nvfp4-e5m3", "mxfp4", "mxfp8"]


# ---------------------------------------------------------------------------- helpers
def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def reference(model, scheme: str, tmp: Path, **kw) -> tuple[torch.nn.Module, Path]:
    q = lowbit.quantize(copy.deepcopy(model), scheme, **kw)
    out = tmp / f"ref-{scheme}"
    lowbit.save(q, out, overwrite=True)
    return q, out






@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory) -> Path:
    """The tiny Llama saved by transformers in 4 shards (tied embeddings: no lm_head tensor)."""
    d = tmp_path_factory.mktemp("src") / "tiny"
    model.save_pretrained(d, max_shard_size="100KB")
    assert len(list(d.glob("*.safetensors"))) >= 3
    (d / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    return d


@pytest.fixture(scope="module")
def token_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 24), generator=g)


# ---------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("scheme", SCHEMES)
def test_same_tensors_and_logits_as_in_memory(model, sharded, token_ids, tmp_path, scheme):
    out = mf(sharded, tmp_path / "mf", scheme)
    q, ref = reference(model, scheme, tmp_path)
    assert_same_tensors(folder_tensors(out), folder_tensors(ref))
    assert "lm_head.weight" not in folder_tensors(out)  # tied: the embedding is written once
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((ref / "config.json").read_text())["quantization_config"]
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    idx = json.loads((out / "lowbit-model.safetensors.index.json").read_text())  # the lowbit format's names
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in folder_tensors(out).values())
    n = len(list(sharded.glob("*.safetensors")))
    assert set(idx["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")} == \
        {f"lowbit-model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    assert not list(out.glob("model*"))  # nothing a stock loader would pick up
    loaded = lowbit.load(out)
    with torch.no_grad():
        assert torch.equal(loaded(token_ids).logits, q(token_ids).logits)


def test_output_file_names_by_format(model, sharded, tmp_path):
    """lowbit format: lowbit-model* files, which transformers refuses loudly (no weights file)
    instead of loading uninitialised weights; compressed-tensors keeps the standard names; a
    single-file source gives a single file."""
    import warnings

    from transformers import AutoModelForCausalLM

    n = len(list(sharded.glob("*.safetensors")))
    ct = mf(sharded, tmp_path / "ct", "w8a16", format="compressed-tensors")
    assert {p.name for p in ct.glob("*.safetensors*")} == \
        {f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)} | {"model.safetensors.index.json"}
    q = lowbit.quantize(copy.deepcopy(model), "w8a16")
    lowbit.save(q, tmp_path / "ct-ref", format="compressed-tensors")
    assert_same_tensors(folder_tensors(ct), folder_tensors(tmp_path / "ct-ref"))
    single = tmp_path / "single"
    model.save_pretrained(single)
    out = mf(single, tmp_path / "lb", "w8a16")
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["lowbit-model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match="model.safetensors"):
            AutoModelForCausalLM.from_pretrained(str(out))
    # a lowbit-format folder given as the source is named as already quantized
    with pytest.raises(FormatError, match="already quantized.*'lowbit'"):
        mf(out, tmp_path / "again", "w8a16")


def round_robin_shards(model, d: Path, n: int = 4) -> Path:
    """Tensors dealt to ``n`` shards in name order: q/k/v and gate/up land in different shards."""
    d.mkdir()
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(sd)
    wm = {k: f"model-{i % n + 1:05d}-of-{n:05d}.safetensors" for i, k in enumerate(names)}
    for f in sorted(set(wm.values())):
        save_file({k: sd[k].contiguous() for k in names if wm[k] == f}, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    model.config.save_pretrained(d)
    return d


def test_bf16_source_fused_groups_across_shards(model, tmp_path):
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    src = round_robin_shards(m16, tmp_path / "bf16")
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    qkv = {wm[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"}
    assert len(qkv) == 3  # the NVFP4 global scale is shared across three shards
    for scheme in ("nvfp4a16", "w4a16"):
        out = mf(src, tmp_path / f"mf-{scheme}", scheme)
        _, ref = reference(m16, scheme, tmp_path)
        assert_same_tensors(folder_tensors(out), folder_tensors(ref))
        assert folder_tensors(out)["model.norm.weight"].dtype == torch.bfloat16
    # reopening the shard files after every tensor (what bounds resident memory) changes nothing
    again = mf(src, tmp_path / "again", "w4a16", run_options=RunOptions(reopen_bytes=1))
    assert folder_bytes(again) == folder_bytes(tmp_path / "mf-w4a16")


def _fp8_block_source(model, d: Path, block=(48, 32)) -> torch.nn.Module:
    """An FP8 block-scaled checkpoint (DeepSeek style) of ``model``; the scales sit in their own
    shard. Returns the bf16 model holding the dequantized weights (what the source means)."""
    d.mkdir()
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    deq = copy.deepcopy(model).to(torch.bfloat16)
    weights, scales = {}, {}
    bo, bi = block
    for name, p in deq.named_parameters():
        if not name.endswith("_proj.weight"):
            continue
        w = p.detach().float()
        o, i = w.shape
        pad = torch.nn.functional.pad(w.abs(), (0, -i % bi, 0, -o % bo))
        amax = pad.reshape(math.ceil(o / bo), bo, math.ceil(i / bi), bi).amax(dim=(1, 3))
        s = amax / 448.0
        full = s.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
        q = (w / full).to(torch.float8_e4m3fn)
        weights[name] = q
        scales[name.replace(".weight", ".weight_scale_inv")] = s
        with torch.no_grad():
            p.copy_((q.float() * full).to(torch.bfloat16))  # independent dequantization
        sd.pop(name)
    shards = {"model-00001-of-00003.safetensors": sd, "model-00002-of-00003.safetensors": weights,
              "model-00003-of-00003.safetensors": scales}
    wm = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        wm.update({k: fname for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = model.config.to_dict()
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps(cfg))
    return deq


def test_fp8_block_source_scales_in_another_shard(model, tmp_path, token_ids):
    deq = _fp8_block_source(model, tmp_path / "fp8")
    out = mf(tmp_path / "fp8", tmp_path / "mf", "nvfp4-e5m3")
    q, ref = reference(deq, "nvfp4-e5m3", tmp_path)
    assert_same_tensors(folder_tensors(out), folder_tensors(ref))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "lowbit"
    # the scale-only source shard writes nothing: two output shards, numbered without a gap
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f"lowbit-model-0000{i}-of-00002.safetensors"
                                                                 for i in (1, 2)]
    with torch.no_grad():  # (a bf16 model built from its config differs from fp32.to(bf16) in rotary buffers)
        assert torch.equal(lowbit.load(out)(token_ids).logits, lowbit.load(ref)(token_ids).logits)
    # an FP8 layer left in float is written dequantized, in the model dtype
    o = "model.layers.1.self_attn.o_proj"
    t = folder_tensors(mf(tmp_path / "fp8", tmp_path / "mf-ignore", "w8a16", ignore=[o]))
    assert torch.equal(t[f"{o}.weight"], deq.get_submodule(o).weight.detach())
    assert f"{o}.weight_scale_inv" not in t and f"{o}.weight_codes" not in t


def test_tied_embeddings_duplicate_head_and_include_lm_head(model, sharded, tmp_path, token_ids):
    # a source that also stores lm_head.weight although the embeddings are tied: written once
    src = tmp_path / "dup"
    src.mkdir()
    for p in sharded.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    emb = model.model.embed_tokens.weight.detach().clone()
    save_file({"lm_head.weight": emb}, str(src / "head.safetensors"))
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["lm_head.weight"] = "head.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    out = mf(src, tmp_path / "mf", "w8a16")
    assert_same_tensors(folder_tensors(out), folder_tensors(mf(sharded, tmp_path / "mf0", "w8a16")))
    # include_lm_head: the head is quantized from the (tied) embedding, the config unties them
    for s in (sharded, src):
        out = mf(s, tmp_path / f"mf-head-{s.name}", "w8a16", include_lm_head=True)
        q, ref = reference(model, "w8a16", tmp_path, include_lm_head=True)
        assert_same_tensors(folder_tensors(out), folder_tensors(ref))
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
        with torch.no_grad():
            assert torch.equal(lowbit.load(out)(token_ids).logits, q(token_ids).logits)


# ---------------------------------------------------------------------------- refusals and bad input
@pytest.mark.parametrize("scheme,alt", [("w8a8-int8", "w8a8-int8-dynamic"), ("w8a8-fp8", "w8a8-fp8-dynamic"),
                                        ("nvfp4", "nvfp4-e5m3")])
def test_calibrated_schemes_refused(sharded, tmp_path, scheme, alt):
    out = tmp_path / "out"
    with pytest.raises(SchemeError, match="needs calibration") as e:
        mf(sharded, out, scheme)
    assert alt in str(e.value) and "calibration=" in str(e.value)
    assert no_output(out)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_truncated_shard(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    out = tmp_path / "out"
    with pytest.raises(FormatError, match=victim.name):
        mf(src, out, "w4a16")
    assert no_output(out)


def test_index_names_missing_shard(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[2]
    victim.unlink()
    out = tmp_path / "out"
    with pytest.raises(FormatError, match=f"{victim.name}.*missing"):
        mf(src, out, "w4a16")
    assert no_output(out)


def test_nan_in_a_weight(model, tmp_path):
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    src = tmp_path / "src"
    m.save_pretrained(src, max_shard_size="100KB")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN") as e:
        mf(src, out, "nvfp4-e5m3")
    assert ".safetensors" in str(e.value)  # names the shard file too
    assert no_output(out)


def test_input_dim_not_a_multiple_of_the_block(tmp_path):
    m = tiny_llama(hidden_size=72, num_attention_heads=4, num_key_value_heads=2)  # 72 = 4.5 blocks of 16
    src = tmp_path / "src"
    m.save_pretrained(src)
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=r"model\.safetensors.*model\.layers\.\d\.\S+_proj\.weight.*72.*block size 16"):
        mf(src, out, "nvfp4-e5m3")
    assert no_output(out)


def test_output_exists_and_output_inside_source(sharded, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(FormatError, match="already exists"):
        mf(sharded, out, "w4a16")
    assert (out / "x").read_text() == "keep me"
    with pytest.raises(FormatError, match="overwrite the source"):
        mf(sharded, sharded, "w4a16")


# ---------------------------------------------------------------------------- resume, workers
KILL_SCRIPT = """
import os, signal, sys
import lowbit
from lowbit.modelfree import RunOptions
done = 0
def hook(event, shard, name):
    global done
    if event == "shard":
        done += 1
    elif done == 2:  # two shards finished, the third one half written: kill -9
        os.kill(os.getpid(), signal.SIGKILL)
lowbit.quantize_checkpoint(sys.argv[1], sys.argv[2], scheme="nvfp4a16", workers=0, progress=False,
                           run_options=RunOptions(on_event=hook))
"""


@pytest.mark.subprocess
def test_killed_run_resumes_byte_identical(sharded, tmp_path):
    import subprocess
    import sys

    full = mf(sharded, tmp_path / "full", "nvfp4a16")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(sharded), str(out)], capture_output=True)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    assert not out.exists()
    tmp = tmp_path / ".out.lowbit-tmp"
    finished = sorted(p.name.removesuffix(".done.json") for p in (tmp / ".modelfree").glob("*.part-*.done.json"))
    assert len(finished) == 2 and len(list(tmp.glob("*.safetensors.partial"))) == 4  # every shard file exists
    assert not list(tmp.glob("*.safetensors"))  # none is complete: the third was being written
    redone: list[str] = []
    on_event = lambda e, n, t: redone.append(n) if e == "shard" else None  # noqa: E731
    mf(sharded, out, "nvfp4a16", workers=2, run_options=RunOptions(on_event=on_event))  # resumes, 2 threads
    assert folder_bytes(out) == folder_bytes(full)
    assert len(redone) == 2 and not set(redone) & set(finished)  # finished shards were not redone
    assert not tmp.exists()


def test_changed_arguments_do_not_resume(sharded, tmp_path):
    out = tmp_path / "out"
    tmp = tmp_path / ".out.lowbit-tmp"
    (tmp / ".modelfree").mkdir(parents=True)
    (tmp / ".modelfree" / "run.json").write_text(json.dumps({"fingerprint": "from another run"}))
    (tmp / "model-00001-of-00004.safetensors").write_bytes(b"stale")
    mf(sharded, out, "w4a16")
    assert folder_bytes(out) == folder_bytes(mf(sharded, tmp_path / "again", "w4a16", resume=False))


@pytest.mark.slow
def test_smollm2_same_logits_as_in_memory(tmp_path):
    """The real model (SmolLM2-135M-Instruct, expanded from its GGUF): model-free nvfp4-e5m3 output
    loads with the same logits as quantizing the loaded model, two shards at a time."""
    from transformers import AutoModelForCausalLM

    from lowbit.models.builtin import ensure_builtin

    folder = ensure_builtin()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    src = round_robin_shards(model, tmp_path / "src", n=3)
    out = mf(src, tmp_path / "mf", "nvfp4-e5m3", workers=2)
    q, ref = reference(model, "nvfp4-e5m3", tmp_path)
    assert_same_tensors(folder_tensors(out), folder_tensors(ref))
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lowbit.load(out)(ids).logits, q(ids).logits)



class _Stop(BaseException):
    """Stands for an interruption (Ctrl-C, a crash) between two units of work."""


def test_large_shards_split_into_parts_same_bytes_and_resume(sharded, tmp_path):
    full = mf(sharded, tmp_path / "full", "nvfp4a16")  # every shard written in one piece
    events: list[str] = []

    def stop_after_three(event, name, tensor):
        if event == "shard":
            events.append(name)
            if len(events) == 3:
                raise _Stop()

    out = tmp_path / "out"
    with pytest.raises(_Stop):  # now every shard is cut into several parts
        mf(sharded, out, "nvfp4a16", run_options=RunOptions(part_bytes=20_000, on_event=stop_after_three))
    assert any(not e.endswith("-of-1") for e in events) and not out.exists()  # shards were cut in parts
    record = lambda e, n, t: events.append(n) if e == "shard" else None  # noqa: E731
    mf(sharded, out, "nvfp4a16", run_options=RunOptions(part_bytes=20_000, on_event=record))
    assert not set(events[:3]) & set(events[3:])  # finished parts were not redone
    assert folder_bytes(out) == folder_bytes(full)  # parts assemble to the same bytes
