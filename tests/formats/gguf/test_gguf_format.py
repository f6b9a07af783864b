"""GGUF as a registered checkpoint format (``Format.GGUF``, lowbit.formats.gguf.format): a model
quantized in memory to a GGML type or mix and written by ``lowbit.save(..., format="gguf")`` is,
byte for byte, the file ``lowbit.quantize_gguf`` writes from its float folder; the format
declares every tensor it writes (name, shape, GGML type) and refuses what it cannot hold."""

from __future__ import annotations

import hashlib

import pytest
import torch

import lowbit
from helpers.gguf_folders import save_gguf_folder, skip_without_converter, tiny_llama_folder
from helpers.models import tiny_llama
from lowbit.errors import FormatError, QuantizationError

skip_without_converter()

from lowbit.formats import FORMATS, LAYOUTS, Container, Format, get_format, get_layout  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.modules.ggml_linear import GgmlLinear  # noqa: E402
from lowbit.numerics.ggml import GgmlType  # noqa: E402


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("untied") / "llama")  # hidden 256: k-quants fit


@pytest.fixture(scope="module")
def tied(tmp_path_factory):  # hidden 64: Q4_K falls back to Q5_0; the output is the token embedding
    return save_gguf_folder(tiny_llama(vocab_size=300), tmp_path_factory.mktemp("tied") / "llama")


def _float(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("target", ["q4_k", "Q4_K_M", "q6_k"])
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_in_memory_then_save_is_quantize_gguf_byte_for_byte(which, target, request, tmp_path):
    folder = request.getfixturevalue(which)
    ref = quantize_gguf(folder, tmp_path / "ref.gguf", target, progress=False)
    model = lowbit.quantize(_float(folder), target)
    out = lowbit.save(model, tmp_path / "mem.gguf", format="gguf")
    assert _sha(out) == _sha(tmp_path / "ref.gguf")
    held = {n: m.kind.name for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    assert held == model.lowbit_gguf_types and len(held) == (15 if which == "untied" else 14)
    if which == "tied":  # no k-quant block fits 64 columns: llama-quantize's fallbacks
        assert set(held.values()) <= {"Q5_0", "Q8_0", "Q5_1"} and "lm_head" not in held
        assert ref.types["token_embd.weight"] not in ("F32", "F16")  # encoded when the file is written
    else:
        assert held["lm_head"] == ref.types["output.weight"]


def test_the_file_holds_the_linears_blocks_as_lowbit_load_reads_them(untied, tmp_path):
    model = lowbit.quantize(_float(untied), "q4_k")
    lowbit.save(model, tmp_path / "m.gguf", format="gguf")
    back = lowbit.load(tmp_path / "m.gguf")
    mine = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    theirs = {n: m for n, m in back.named_modules() if isinstance(m, GgmlLinear)}
    assert set(mine) == set(theirs)
    for n, m in mine.items():  # rows in the model's order on both sides (q/k permuted in the file)
        assert m.kind is theirs[n].kind and torch.equal(m.weight_data, theirs[n].weight_data), n


def test_declared_tensors_are_the_written_ones(untied, tmp_path):
    import gguf

    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.formats.gguf.mixes import Mix

    fmt = get_format(Format.GGUF)
    plan = plan_gguf(untied)
    for target in (Mix.Q4_K_M, GgmlType.Q3_K, GgmlType.NVFP4):
        types = fmt.tensor_types(plan, target)
        declared = fmt.tensor_specs(plan, types)
        quantize_gguf(untied, tmp_path / f"{target.value}.gguf", target.value, progress=False)
        written = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
                   for t in gguf.GGUFReader(tmp_path / f"{target.value}.gguf").tensors}
        assert list(written) == list(declared)
        assert written == {n: (s.shape, s.type) for n, s in declared.items()}, target


def test_the_format_is_registered_and_owns_its_rules():
    fmt = get_format("gguf")
    assert fmt in FORMATS and fmt not in LAYOUTS and fmt.container is Container.FILE
    assert fmt.target("Q4_K_M").value == "Q4_K_M" and fmt.target("q4_k") is GgmlType.Q4_K
    with pytest.raises(FormatError, match="not lowbit's scheme 'w4a16'"):
        fmt.check_scheme(lowbit.get_scheme("w4a16"))
    with pytest.raises(FormatError, match="unknown GGUF scheme 'q9_k'"):
        fmt.check_scheme("q9_k")
    with pytest.raises(FormatError, match="one file written whole"):
        get_layout(Format.GGUF)


def test_ggml_names_and_lowbit_presets_do_not_collide():
    from lowbit.gguf_memory import ggml_target

    assert ggml_target("mxfp4") is None and ggml_target("nvfp4") is None  # lowbit's presets
    assert ggml_target(GgmlType.MXFP4) is GgmlType.MXFP4 and ggml_target("q8_0").value == "Q8_0"
    assert ggml_target("w4a16") is None and ggml_target({"default": "w4a16"}) is None


def test_bad_combinations_are_one_line_errors(untied, tmp_path):
    with pytest.raises(QuantizationError) as e:
        lowbit.quantize(_float(untied), "q4_k", num_samples=2)  # a calibration option without calibration data
    assert "'num_samples'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(QuantizationError, match="'ignore'"):
        lowbit.quantize(_float(untied), "q4_k", ignore=["lm_head"])
    model = lowbit.quantize(_float(untied), "q4_k")
    with pytest.raises(FormatError, match="format='gguf'"):
        lowbit.save(model, tmp_path / "folder", format="lowbit")
    with pytest.raises(FormatError, match="quantized to a GGML type"):
        lowbit.save(lowbit.quantize(_float(untied), "w8a16"), tmp_path / "x.gguf", format="gguf")
    with pytest.raises(FormatError, match="source folder"):
        lowbit.save(model, untied / "inside.gguf", format="gguf")
    (tmp_path / "there.gguf").write_bytes(b"x")
    with pytest.raises(FormatError, match="exists"):
        lowbit.save(model, tmp_path / "there.gguf", format="gguf")
    assert not (untied / "inside.gguf").exists() and (tmp_path / "there.gguf").read_bytes() == b"x"


def test_a_model_without_a_source_folder_quantizes_but_needs_one_to_save(tmp_path):
    model = tiny_llama(vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=False)
    lowbit.quantize(model, "q4_k")  # the converter's tensor plan from the config alone
    assert set(model.lowbit_gguf_types.values()) == {"Q4_K"}
    with pytest.raises(FormatError, match="source_dir"):
        lowbit.save(model, tmp_path / "m.gguf", format="gguf")
    with pytest.raises(FormatError, match="source_dir"):
        lowbit.quantize(tiny_llama(vocab_size=300), "Q4_K_M")  # a mix needs the metadata


def test_quantize_checkpoint_with_format_gguf_is_quantize_gguf(untied, tmp_path):
    """``lowbit.quantize_checkpoint(src, out, mix, "gguf")`` is the GGUF format's run (the API's
    one entry for every checkpoint format, as ``lowbit quantize --format gguf``); the options that
    do not apply to a GGUF file are refused by name before any work."""
    ref = quantize_gguf(untied, tmp_path / "ref.gguf", "Q4_K_M", progress=False)
    out = lowbit.quantize_checkpoint(untied, tmp_path / "api.gguf", "Q4_K_M", "gguf", progress=False)
    assert out == tmp_path / "api.gguf" and _sha(out) == _sha(ref.path)
    with pytest.raises(QuantizationError, match="drop ignore, device"):
        lowbit.quantize_checkpoint(untied, tmp_path / "x.gguf", "Q4_K_M", "gguf", ignore=["lm_head"], device="cpu")
    assert not (tmp_path / "x.gguf").exists()
