"""llama.cpp itself (llama-cpp-python) runs lowbit's GGUF files: a tiny Llama written by
``lowbit.quantize_gguf`` at three mixes, calibrated (GPTQ within the grid) and not, loads in
llama.cpp and its logits are those of the model whose weights are the file's decoded weights
(gguf-py's dequantization, through transformers), up to the activation rounding llama.cpp's CPU
matmuls add - much closer than the float model those weights came from. Slow: llama-cpp-python compiles llama.cpp when installed
(``pip install llama-cpp-python``); skipped where it is not installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_folders import save_gguf_folder, skip_without_converter, tiny_llama_folder
from helpers.llama_cpp_logits import logits as _llama_cpp_logits, rel_error as _rel

skip_without_converter()
llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (compiles llama.cpp)")

from lowbit.gguf_quantize import quantize_gguf  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


def _ids() -> list[int]:
    return torch.randint(3, 300, (48,), generator=torch.Generator().manual_seed(3)).tolist()


def _hf_logits(path, ids: list[int]) -> np.ndarray:
    """transformers' logits of a float folder, or of a .gguf file as gguf-py dequantizes it (the
    values llama.cpp holds)."""
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent if gguf else path), dtype=torch.float32, **gguf)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M", "Q2_K"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_llama_cpp_runs_lowbits_file_as_its_decoded_weights(folder, tmp_path, mix, calibrated):
    out = tmp_path / f"{mix}.gguf"
    calib = torch.randint(3, 300, (4, 64), generator=torch.Generator().manual_seed(1)) if calibrated else None
    report = quantize_gguf(folder, out, mix, calibration=calib, progress=False)
    assert out.is_file() and report.types
    ids = _ids()
    got = _llama_cpp_logits(out, ids)
    decoded = _hf_logits(out, ids)
    floats = _hf_logits(folder, ids)
    assert np.isfinite(got).all()
    # llama.cpp computes with the file's weights: its logits are the decoded model's up to its own
    # rounding of the activations (Q8_0 / Q8_K before each quantized matmul, an F16 KV cache),
    # measured 0.01-0.03 here, and far from the float model's (0.13-0.46 at Q4_K_M / Q2_K)
    err, drift = _rel(got, decoded), _rel(decoded, floats)
    assert err < 0.05, (err, drift)
    if mix != "Q8_0":
        assert err < drift / 2, (err, drift)
    assert (got.argmax(-1) == decoded.argmax(-1)).mean() >= 0.85  # random weights: small margins (0.90-1.0 here)


def test_llama_cpp_runs_an_moe_file_with_experts_rounded_per_expert(tmp_path):
    """Mixtral (experts stored one by one, stacked by the converter into ffn_*_exps) at Q8_0 with
    GPTQ per expert: llama.cpp's logits are the float model's to within the rounding."""
    from helpers.moe_models import tiny_moe

    folder = save_gguf_folder(tiny_moe("mixtral"), tmp_path / "mixtral")
    calib = torch.randint(3, 250, (4, 64), generator=torch.Generator().manual_seed(1))
    report = quantize_gguf(folder, tmp_path / "m.gguf", "Q8_0", calibration=calib, progress=False)
    assert "blk.0.ffn_gate_exps.weight" in report.from_encoded
    ids = [i % 250 + 3 for i in _ids()]
    got, floats = _llama_cpp_logits(tmp_path / "m.gguf", ids), _hf_logits(folder, ids)
    assert _rel(got, floats) < 0.05, _rel(got, floats)
    assert (got.argmax(-1) == floats.argmax(-1)).mean() >= 0.85
