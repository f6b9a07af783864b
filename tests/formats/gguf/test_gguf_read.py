"""Reading a GGUF file back with its GGML blocks kept (lowbit.load on a .gguf, GgmlLinear): the
modules hold the file's bytes (rows moved as transformers moves them), the logits equal those of
transformers' float model of the same file bit for bit, a mapping that does not hold is a one-line
FormatError, and llama.cpp's numerics (activations rounded to the vec_dot type, F16 KV cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_folders import skip_without_converter, tiny_llama_folder
from lowbit.errors import FormatError, LowbitError

skip_without_converter()

import lowbit  # noqa: E402
from lowbit.formats.gguf import read  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.modules.ggml_linear import GgmlLinear  # noqa: E402
from lowbit.numerics.ggml import GgmlType, decode, encode  # noqa: E402
from lowbit.numerics.ggml_act import DotInput  # noqa: E402
from lowbit.quant.serving import ServingNumerics  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def q4_k_m(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4km") / "m.gguf"
    quantize_gguf(folder, out, "Q4_K_M", progress=False)
    return out


def _float_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _ids():
    return torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(1))


def test_linears_hold_the_files_blocks_and_logits_equal_the_float_model(q4_k_m):
    import gguf

    model = lowbit.load(q4_k_m)
    tensors = {t.name: t for t in gguf.GGUFReader(q4_k_m).tensors}
    mods = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    assert len(mods) == 2 * 7 + 1                        # every projection and the output layer
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lowbit_gguf_types["model.layers.1.self_attn.v_proj"] == "Q6_K"
    assert model.lowbit_gguf_types["model.layers.0.self_attn.q_proj"] == "Q4_K"
    q = mods["model.layers.0.self_attn.q_proj"]
    raw = torch.from_numpy(np.array(tensors["blk.0.attn_q.weight"].data))
    assert q.kind is GgmlType.Q4_K and q.weight_data.dtype == torch.uint8
    # the file's rows, moved whole (Llama's rope permutation undone): same multiset, other order
    assert not torch.equal(q.weight_data, raw)
    assert sorted(map(bytes, q.weight_data.numpy())) == sorted(map(bytes, raw.numpy()))
    down = mods["model.layers.1.mlp.down_proj"]
    assert torch.equal(down.weight_data, torch.from_numpy(np.array(tensors["blk.1.ffn_down.weight"].data)))
    ref = _float_model(q4_k_m)
    for name, m in mods.items():
        assert torch.equal(m.decoded_weight(), ref.get_submodule(name).weight), name
    with torch.no_grad():
        a, b = model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits
    assert torch.equal(a, b)                             # bit for bit
    assert not hasattr(q, "weight")                      # no float copy kept


def test_pure_types_load_and_match(folder, tmp_path):
    # one file per 32-block type family: Q4_1 (min: Q8_1 inputs in llama.cpp), Q5_0, Q8_0
    for scheme, kind in (("q4_1", GgmlType.Q4_1), ("q5_0", GgmlType.Q5_0), ("q8_0", GgmlType.Q8_0)):
        out = tmp_path / f"{scheme}.gguf"
        quantize_gguf(folder, out, scheme, progress=False)
        model = lowbit.load(out)
        kinds = {m.kind for m in model.modules() if isinstance(m, GgmlLinear)}
        assert kind in kinds, scheme
        with torch.no_grad():
            assert torch.equal(model(input_ids=_ids()).logits, _float_model(out)(input_ids=_ids()).logits), scheme


def test_a_row_map_that_does_not_hold_is_one_formaterror(q4_k_m, monkeypatch):
    real = read.row_order

    def identity_for_q(processor, key_map, parsed, name, rows):
        found = real(processor, key_map, parsed, name, rows)
        return (found[0], np.arange(rows)) if name == "blk.0.attn_q.weight" else found

    monkeypatch.setattr(read, "row_order", identity_for_q)
    with pytest.raises(FormatError) as e:
        lowbit.load(q4_k_m)
    msg = str(e.value)
    assert "blk.0.attn_q.weight" in msg and "bit for bit" in msg and "\n" not in msg


def test_damaged_or_foreign_files_are_one_line_errors(q4_k_m, folder, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q4_k_m.read_bytes()[: q4_k_m.stat().st_size // 2])
    with pytest.raises(FormatError) as e:
        lowbit.load(cut)
    assert "\n" not in str(e.value) and "cut.gguf" in str(e.value)
    other = tmp_path / "x.gguf"
    other.write_bytes(b"not a gguf file")
    with pytest.raises(FormatError, match="not a GGUF file"):
        lowbit.load(other)
    with pytest.raises(LowbitError, match="not an engine that serves GGUF"):
        lowbit.load(q4_k_m, numerics=ServingNumerics.VLLM_CPU)
    with pytest.raises(LowbitError, match="llama.cpp's on a GGUF file"):
        lowbit.load(folder, numerics=ServingNumerics.LLAMA_CPP_CPU)
    with pytest.raises(LowbitError, match="float32"):
        lowbit.load(q4_k_m, backend="reference")


def test_llama_cpp_numerics_round_the_inputs_and_the_kv_cache(q4_k_m):
    model = lowbit.load(q4_k_m, numerics=ServingNumerics.LLAMA_CPP_CPU)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    assert mods["model.layers.0.self_attn.q_proj"].dot_input is DotInput.Q8_K
    assert all(m.dot_input is m.llama_dot_input for m in mods.values())
    assert model.config._attn_implementation == "lowbit_llama_cpp_f16_kv"
    plain = lowbit.load(q4_k_m)
    from lowbit.eval.spread import has_quantized_activations

    assert has_quantized_activations(model) and not has_quantized_activations(plain)  # llama.cpp's has a spread
    with torch.no_grad():
        a, b = model(input_ids=_ids()).logits, plain(input_ids=_ids()).logits
    assert not torch.equal(a, b)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())   # a rounding, not another model


def test_q8_1_min_term_is_taken_with_the_stored_block_sum():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    x = torch.randn(3, 64) * 3
    data = encode(w, GgmlType.Q4_1)
    lin = GgmlLinear(data, GgmlType.Q4_1, dot_input=DotInput.Q8_1)
    y = lin(x).double()
    # llama.cpp's ggml_vec_dot_q4_1_q8_1, block by block: d_w d_x sum(q_w q_x) + m_w s_x
    from lowbit.numerics.ggml_act import q8_0_codes
    from lowbit.numerics.ggml_codes import codes_of, grid_of

    qx, dx = q8_0_codes(x)                                   # [3 * 2, 32]
    dx16 = dx.to(torch.float16).double().reshape(3, 2)
    sx = (dx * qx.sum(1).float()).to(torch.float16).double().reshape(3, 2)
    grid = grid_of(data, GgmlType.Q4_1)
    cw = codes_of(data, GgmlType.Q4_1).double().reshape(8, 2, 32)
    sumi = torch.einsum("tbk,obk->tob", qx.double().reshape(3, 2, 32), cw)
    want = (grid.step.double()[None] * dx16[:, None] * sumi - grid.offset.double()[None] * sx[:, None]).sum(-1)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    # without the stored s (x values @ decoded W alone) the result is off by more than that
    from lowbit.numerics.ggml_act import dot_input_values

    plain = torch.nn.functional.linear(dot_input_values(x, DotInput.Q8_1)[0], decode(data, GgmlType.Q4_1)).double()
    assert not torch.allclose(plain, want, rtol=1e-5, atol=1e-5)


def test_decoded_weight_is_the_one_decoder():
    torch.manual_seed(2)
    w = torch.randn(4, 256)
    for kind in (GgmlType.Q2_K, GgmlType.Q6_K, GgmlType.MXFP4, GgmlType.NVFP4):
        data = encode(w, kind)
        lin = GgmlLinear(data, kind)
        assert torch.equal(lin.decoded_weight(), decode(data, kind))
        assert torch.equal(lin(w[:1]), torch.nn.functional.linear(w[:1], decode(data, kind)))
    with pytest.raises(FormatError, match="tensor 'x'"):
        GgmlLinear(torch.zeros(2, 10, dtype=torch.uint8), GgmlType.Q4_K, name="x")
