"""Reading a GGUF file with its quantized weights kept as GGML blocks: ``load_gguf``.

    model = lowbit.load("model-Q4_K_M.gguf")       # lowbit's or llama-quantize's file
    model = lowbit.load("model-Q4_K_M.gguf", numerics=ServingNumerics.LLAMA_CPP_CPU)

transformers reads the file as it does for any GGUF (``from_pretrained(gguf_file=...)``: the
architecture, the config, every tensor dequantized by gguf-py to float32). Then every ``nn.Linear``
whose GGUF tensor is of a GGML type lowbit decodes (``lowbit.numerics.ggml.GgmlType``) becomes a
``GgmlLinear`` holding that tensor's bytes, row for row, and its float weight is dropped; float
tensors (F32 / F16 / BF16), norms and embeddings stay the float tensors transformers made (an
embedding lookup is llama.cpp's dequantizing ``get_rows``: the same values). A tied output layer
(no ``output.weight`` in the file) holds the token embedding's blocks, as llama.cpp computes it.

Row order: transformers moves the rows of some tensors (Llama's q/k rope permutation, undone per
head). The move is learned from transformers' own tensor processor, fed an index column in place
of the weight, and checked: the moved rows, decoded, must equal transformers' dequantized weight
bit for bit, else a FormatError names the tensor. Memory: the float model exists once while
transformers loads it; afterwards each quantized linear holds its bytes only (decoded per forward).
Stacked MoE experts (not ``nn.Linear``) and types lowbit has no decoder for (IQ*, TQ*) stay float,
with a warning naming them.

``numerics``: LOWBIT computes what the file means (x @ decode(W).T in float32; logits equal the
float model with the decoded weights bit for bit). LLAMA_CPP_CPU computes as llama.cpp's CPU
backend does (``lowbit.numerics.ggml_act``: activations rounded to each weight type's
``vec_dot_type``; attention on K and V rounded to fp16, its default F16 KV cache:
``lowbit.modules.llama_cpp_attention``).
"""

from __future__ import annotations

import enum
import functools
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from lowbit.errors import FormatError, LowbitError
from lowbit.numerics.ggml import GgmlType, decode


class GgufWeights(str, enum.Enum):
    """How ``lowbit.models.load_model`` / ``lowbit eval`` read a GGUF file's quantized weights."""

    CODES = "codes"   # its GGML blocks kept (``load_gguf``), decoded per forward
    FLOAT = "float"   # transformers' float32 expansion (the same logits under LOWBIT numerics)


DEFAULT_GGUF_WEIGHTS = GgufWeights.CODES


@functools.cache
def _gguf_types() -> dict:
    import gguf

    return {gguf.GGMLQuantizationType[k.name]: k for k in GgmlType if k.name in gguf.GGMLQuantizationType.__members__}


@functools.cache
def _float_types() -> frozenset:
    """gguf-py's float tensor types: F32, F16, BF16 (kept as transformers' float tensors)."""
    import gguf

    q = gguf.GGMLQuantizationType
    return frozenset((q.F32, q.F16, q.BF16))


def _ggml_type(t) -> GgmlType | None:
    """lowbit's GgmlType of a gguf-py tensor type (None: a float type or one lowbit does not decode)."""
    return _gguf_types().get(t)


def file_tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its GGML type name (gguf-py's, e.g. "Q4_K", "F32"), from the header only
    (``lowbit.formats.gguf.keys``; gguf-py's reader for a header that one leaves to it)."""
    import gguf

    from lowbit.formats.gguf.keys import Unsupported, read_tensor_types

    try:
        return {n: gguf.GGMLQuantizationType(t).name for n, t in read_tensor_types(path).items()}
    except Unsupported:
        return {t.name: t.tensor_type.name for t in _reader(Path(path)).tensors}
    except (OSError, ValueError) as e:  # an unknown type code is a ValueError too
        raise FormatError(f"GGUF: cannot read {str(path)!r}: {e}") from None


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as e:
        raise FormatError(f"GGUF: cannot read {str(path)!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          ) from None


def _float_model(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, ImportError, OSError, RuntimeError, KeyError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(f"GGUF {str(path)!r}: transformers cannot load it: {first}") from None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval()


def _processor(reader, model: nn.Module):
    """transformers' tensor processor for the file's architecture (given the model's config, as
    transformers gives it the config it parsed from the file), its GGUF -> HF name map, and the
    parsed parameters it takes (a scratch dict: MoE processors file expert tensors there)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    arch = reader.fields["general.architecture"].contents()
    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    return processor, get_gguf_hf_weights_map(model, processor), {"config": config, "tensors": {}}


def row_order(processor, key_map: dict, parsed: dict, gguf_name: str, rows: int) -> tuple[str, np.ndarray] | None:
    """(the transformers name, ``perm``) where HF row i is GGUF row ``perm[i]``, learned by passing an
    index column through transformers' own processor; None when the processor changes the column
    into something other than a permutation of its rows (the tensor cannot be kept as blocks)."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    res = processor.process(weights=index.copy(), name=gguf_name, tensor_key_mapping=key_map,
                            parsed_parameters=parsed)
    w = np.asarray(res.weights)
    if res.name not in key_map or w.shape != (rows, 1):
        return None
    perm = w[:, 0]
    if not np.array_equal(np.sort(perm), index[:, 0]):
        return None
    return key_map[res.name], perm.astype(np.int64)


def load_gguf(path: str | Path, numerics=None) -> nn.Module:
    """The model of GGUF file ``path`` with its quantized linears as ``GgmlLinear`` (module docstring).

    ``numerics``: a ``lowbit.quant.serving.ServingNumerics``, LOWBIT (default) or LLAMA_CPP_CPU;
    another is a LowbitError. Sets ``model.lowbit_format = "gguf"`` and ``model.lowbit_gguf_types``
    (module name -> GGML type of every linear, float ones included)."""
    from lowbit.modules.ggml_linear import GgmlLinear
    from lowbit.quant.serving import ServingNumerics
    from lowbit.targets import set_submodule

    numerics = ServingNumerics.LOWBIT if numerics is None else numerics
    if numerics not in (ServingNumerics.LOWBIT, ServingNumerics.LLAMA_CPP_CPU):
        raise LowbitError(f"numerics {numerics.value!r} are not an engine that serves GGUF files; "
                          f"use 'lowbit' or 'llama-cpp-cpu'")
    path = Path(path)
    reader = _reader(path)
    model = _float_model(path)
    processor, key_map, parsed = _processor(reader, model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    by_weight = {f"{n}.weight": n for n in linears}
    tensors = {t.name: t for t in reader.tensors}
    out_emb = model.get_output_embeddings()
    out_name = next((n for n, m in linears.items() if m is out_emb), None)
    jobs = []  # (module name, GGUF tensor)
    for t in reader.tensors:
        hf = key_map.get(t.name)
        if hf in by_weight:
            jobs.append((by_weight[hf], t))
    if out_name is not None and not any(n == out_name for n, _ in jobs) and "token_embd.weight" in tensors \
            and getattr(model.config, "tie_word_embeddings", False):
        jobs.append((out_name, tensors["token_embd.weight"]))  # llama.cpp's output is the token embedding
    types: dict[str, str] = {}
    undecoded: list[str] = []
    for name, t in jobs:
        lin = linears[name]
        types[name] = t.tensor_type.name
        kind = _ggml_type(t.tensor_type)
        if kind is None:
            if t.tensor_type not in _float_types():
                undecoded.append(f"{t.name} ({t.tensor_type.name})")
            continue
        data = torch.from_numpy(np.array(t.data))  # a copy: the reader's memory map is read-only
        rows = data.shape[0] if data.dim() == 2 else -1
        found = row_order(processor, key_map, parsed, t.name, rows) if rows > 0 else None
        if found is None:
            raise FormatError(f"GGUF {str(path)!r}: tensor {t.name!r} ({kind.value}): transformers changes it in a "
                              f"way that does not move whole rows; it cannot be kept as GGML blocks")
        data = data[torch.from_numpy(found[1])]
        if tuple(data.shape[:1]) != (lin.out_features,) or not torch.equal(decode(data, kind), lin.weight.detach()):
            raise FormatError(f"GGUF {str(path)!r}: tensor {t.name!r} ({kind.value}) decoded does not equal "
                              f"transformers' weight of {name!r} bit for bit: its rows cannot be mapped")
        set_submodule(model, name, GgmlLinear(data, kind, lin.bias, name=name))
    if undecoded:
        warnings.warn(f"GGUF {str(path)!r}: {len(undecoded)} linear weights are of GGML types lowbit does not decode "
                      f"and stay transformers' float (e.g. {undecoded[0]})", stacklevel=2)
    if numerics is ServingNumerics.LLAMA_CPP_CPU:
        from lowbit.modules.llama_cpp_attention import use_llama_cpp_attention

        use_llama_cpp_numerics(model)
        use_llama_cpp_attention(model)
    model.lowbit_format = "gguf"
    model.lowbit_gguf_types = types
    return model


def use_llama_cpp_numerics(model: nn.Module) -> int:
    """Every ``GgmlLinear`` of ``model`` rounds its inputs as llama.cpp's CPU backend does; the count."""
    from lowbit.modules.ggml_linear import GgmlLinear

    n = 0
    for m in model.modules():
        if isinstance(m, GgmlLinear):
            m.dot_input = m.llama_dot_input
            n += 1
    return n
