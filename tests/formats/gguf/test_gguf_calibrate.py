"""GGML types calibrated in memory (``lowbit.gguf_calibrate``): ``lowbit.quantize(model, "Q4_K_M",
calibration=ids)`` then ``lowbit.save(..., format="gguf")`` writes, byte for byte, the file
``lowbit.quantize_gguf(folder, ..., calibration=ids)`` writes with the same windows and options;
the options a GGUF file's calibration does not read are refused by name."""

from __future__ import annotations

import hashlib

import pytest
import torch

import lowbit
from helpers.gguf_folders import save_gguf_folder, skip_without_converter, tiny_llama_folder
from helpers.models import tiny_llama
from lowbit.errors import QuantizationError

skip_without_converter()

from lowbit.calibration import CalibrationConfig  # noqa: E402
from lowbit.errors import FormatError  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.modules.ggml_linear import GgmlLinear  # noqa: E402
from lowbit.numerics.ggml import GgmlType  # noqa: E402


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("untied") / "llama")  # hidden 256: k-quants fit


@pytest.fixture(scope="module")
def tied(tmp_path_factory):  # hidden 64: Q5_0 / Q8_0 fallbacks; the output is the token embedding
    return save_gguf_folder(tiny_llama(vocab_size=300), tmp_path_factory.mktemp("tied") / "llama")


def _float(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids(n=4, seq=32, vocab=300, seed=0):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("rounding", ["gptq", "rtn"])
@pytest.mark.parametrize("which,target", [("untied", "Q4_K_M"), ("untied", "q2_k"), ("tied", "Q4_K_M"),
                                          ("tied", "q4_0"), ("untied", GgmlType.NVFP4), ("tied", GgmlType.MXFP4)])
def test_calibrated_in_memory_then_save_is_quantize_gguf_byte_for_byte(which, target, rounding, request, tmp_path):
    folder = request.getfixturevalue(which)
    cfg = CalibrationConfig(num_samples=4, seq_len=32, batch_size=2, weight_rounding=rounding)
    ids = _ids()
    ref = quantize_gguf(folder, tmp_path / "ref.gguf", target, calibration=ids, config=cfg, progress=False)
    model = lowbit.quantize(_float(folder), target, ids, config=cfg)
    out = lowbit.save(model, tmp_path / "mem.gguf", format="gguf")
    assert _sha(out) == _sha(tmp_path / "ref.gguf")
    plain = quantize_gguf(folder, tmp_path / "plain.gguf", target, progress=False)
    fp4 = target in (GgmlType.MXFP4, GgmlType.NVFP4)  # llama.cpp's FP4 encoders take no importance
    assert (_sha(tmp_path / "plain.gguf") == _sha(out)) == (fp4 and rounding == "rtn")
    if rounding == "gptq":
        assert ref.from_encoded  # GPTQ's codes reached the file
    held = [m for m in model.named_modules() if isinstance(m[1], GgmlLinear)]
    assert held and plain.types == ref.types


def test_calibrated_linears_compute_what_the_file_holds(untied, tmp_path):
    ids = _ids()
    model = lowbit.quantize(_float(untied), "q4_k", ids, num_samples=4, seq_len=32, importance_search="llama-cpp")
    out = lowbit.save(model, tmp_path / "m.gguf", format="gguf")
    back = lowbit.load(out)
    plain = lowbit.quantize(_float(untied), "q4_k")
    mine = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    theirs = {n: m for n, m in back.named_modules() if isinstance(m, GgmlLinear)}
    assert set(mine) == set(theirs) and len(mine) == 15
    moved = 0
    for n, m in mine.items():  # rows in the model's order on both sides (q/k permuted in the file)
        assert m.kind is theirs[n].kind and torch.equal(m.weight_data, theirs[n].weight_data), n
        moved += not torch.equal(m.weight_data, plain.get_submodule(n).weight_data)
    assert moved == len(mine)  # every linear's blocks differ from the uncalibrated rounding


def test_options_a_gguf_calibration_does_not_read_are_refused_by_name(untied):
    ids = _ids()
    for kw, name in [({"reconstruct_scales": True}, "reconstruct_scales"), ({"observer": "mse"}, "observer"),
                     ({"config": CalibrationConfig(gptq_act_order=True)}, "gptq_act_order"),
                     ({"smoothquant": 0.5}, "smoothquant"), ({"importance_search": "nope"}, "importance_search")]:
        with pytest.raises(QuantizationError) as e:
            lowbit.quantize(_float(untied), "Q4_K_M", ids, **kw)
        assert repr(name) in str(e.value) or f"{name}:" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(QuantizationError, match="'tokenizer'"):
        lowbit.quantize(_float(untied), "Q4_K_M", tokenizer=object())  # a tokenizer without calibration data


def test_every_entry_point_reads_the_same_calibration_options(untied, tmp_path):
    """``quantize_checkpoint(..., "gguf", calibration=, num_samples=...)`` and ``lowbit.quantize``
    read the options alike (``lowbit.gguf_options.gguf_calibration_config``); ``quantize_gguf``
    refuses a config field it would not read, before any work."""
    ids = _ids()
    opts = {"num_samples": 2, "seq_len": 16, "importance_search": "llama-cpp", "weight_rounding": "rtn"}
    out = lowbit.quantize_checkpoint(untied, tmp_path / "api.gguf", "Q4_K_M", "gguf", calibration=ids,
                                     progress=False, **opts)
    model = lowbit.quantize(_float(untied), "Q4_K_M", ids, **opts)
    assert _sha(lowbit.save(model, tmp_path / "mem.gguf", format="gguf")) == _sha(out)
    ref = quantize_gguf(untied, tmp_path / "ref.gguf", "Q4_K_M", calibration=ids, progress=False,
                        config=CalibrationConfig(num_samples=2, seq_len=16, weight_rounding="rtn"),
                        importance_search="llama-cpp")
    assert _sha(ref.path) == _sha(out)
    with pytest.raises(QuantizationError, match="'reconstruct_scales'"):
        quantize_gguf(untied, tmp_path / "no.gguf", "Q4_K_M", calibration=ids,
                      config=CalibrationConfig(reconstruct_scales=True))
    with pytest.raises(QuantizationError, match="drop num_samples"):
        lowbit.quantize_checkpoint(untied, tmp_path / "no.gguf", "Q4_K_M", "gguf", num_samples=2)
    assert not (tmp_path / "no.gguf").exists()
    with pytest.raises(FormatError, match="calibration options need calibration data"):  # not ignored
        quantize_gguf(untied, tmp_path / "no.gguf", "Q4_K_M", config=CalibrationConfig(num_samples=2))
    assert not (tmp_path / "no.gguf").exists() and not list(tmp_path.glob(".no.gguf*"))
