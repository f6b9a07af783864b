"""GGML types in memory: ``lowbit.quantize(model, "q4_k")`` and ``lowbit.save(model, "x.gguf",
format="gguf")``, through the registered GGUF format (``lowbit.formats.gguf.format.GgufFormat``).

    model, tok = lowbit.load_model("./model")
    lowbit.quantize(model, "q4_k")                   # or a mix: "Q4_K_M"; GgmlType.MXFP4 / NVFP4
    lowbit.save(model, "model-q4_k.gguf", format="gguf")

Quantizing asks the format which GGML type every GGUF tensor gets (llama.cpp's converter's plan
of the model's tensors, then llama-quantize's rules and fallbacks, as ``lowbit.quantize_gguf``
does for a folder) and replaces every ``nn.Linear`` whose weight becomes a GGML tensor with a
``GgmlLinear`` holding its blocks, encoded by ``lowbit.numerics.ggml`` (llama.cpp's reference
quantizer). What is not a linear (the token embedding, experts stored fused) stays float in memory
and is encoded when the file is written, as llama-quantize does; so are rows that fall back to F16.

With calibration data (``lowbit.quantize(model, "Q4_K_M", ids_or_text, tokenizer=...)``) the
blocks are ``quantize_gguf``'s calibrated ones: importance-weighted scales and GPTQ's codes
(``lowbit.gguf_calibrate``), and the file is that function's with the same windows, byte for byte.

Saving plans again (metadata and tokenizer from the source folder), hands the linears' blocks to
the writer as they are (``encoded``) and encodes the rest: for a float model quantized without
calibration the file equals ``lowbit.quantize_gguf(folder, out, target)`` byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lowbit.errors import FormatError, OptionRef, QuantizationError
from lowbit.formats import Format, get_format
from lowbit.formats.gguf.format import GgufTarget
from lowbit.formats.gguf.mixes import Mix
from lowbit.modules.ggml_linear import GgmlLinear
from lowbit.numerics.ggml import GgmlType

#: the attribute a model quantized to a GGUF target carries (its Mix or GgmlType), for lowbit.save
TARGET_ATTR = "lowbit_gguf_target"


def ggml_target(scheme: Any) -> GgufTarget | None:
    """The GGUF target ``lowbit.quantize``'s ``scheme`` names: a ``GgmlType`` or ``Mix``, or a
    string the GGUF format reads as one (``q4_k``, ``Q4_K_M``, ``q8_0``) and that is not a lowbit
    preset (``mxfp4`` and ``nvfp4`` are lowbit's schemes: pass ``GgmlType.MXFP4`` for GGML's);
    None for anything else (a lowbit scheme or recipe)."""
    from lowbit.schemes import PRESETS

    if isinstance(scheme, (GgmlType, Mix)):
        return scheme
    if not isinstance(scheme, str) or scheme in PRESETS:
        return None
    try:
        return get_format(Format.GGUF).target(scheme)
    except FormatError:
        return None


def source_folder(model: nn.Module, source_dir: str | os.PathLike | None) -> Path | None:
    """``source_dir``, or the local folder the model was loaded from (None when there is none)."""
    if source_dir is not None:
        return Path(source_dir)
    p = getattr(getattr(model, "config", None), "_name_or_path", None)
    return Path(str(p)) if p and (Path(str(p)) / "config.json").is_file() else None


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name, in ``state_dict`` order, as ``save_pretrained``
    writes them: a tied output embedding left out, a ``GgmlLinear``'s weight as a meta tensor of
    its [out, in] shape (the converter's plan needs only its shape; its rows are the blocks)."""
    held = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out_emb = getattr(model, "get_output_embeddings", lambda: None)()
    in_emb = getattr(model, "get_input_embeddings", lambda: None)()
    tied_out = tied and out_emb is not None and in_emb is not None and \
        getattr(out_emb, "weight", None) is getattr(in_emb, "weight", None)
    out: dict[str, torch.Tensor] = {}
    for key, v in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if tied_out and model.get_submodule(module) is out_emb:
            continue  # written once, as the input embedding (transformers ties it again)
        m = held.get(module)
        if m is None:
            out[key] = v.detach()
        elif leaf == "weight_data":
            out[f"{module}.weight"] = torch.empty(m.out_features, m.in_features, device="meta")
            if m.bias is not None:
                out[f"{module}.bias"] = m.bias.detach()
    return out


def _plan(model: nn.Module, folder: Path | None, metadata: bool):
    """The converter's plan of the model's tensors (``lowbit.formats.gguf.convert.plan_gguf``),
    from ``folder`` (config.json, and the tokenizer when ``metadata``) or, without one, a config.json
    written from the model's config into a temporary folder (tensors only)."""
    import tempfile

    from lowbit.formats.gguf.convert import plan_gguf

    tensors = model_tensors(model)
    if folder is not None:
        return plan_gguf(folder, tensors=in_folder_order(tensors, folder), metadata=metadata)
    if metadata:
        raise FormatError("a GGUF mix needs the model's metadata from its source folder (config.json and tokenizer, "
                          "which llama.cpp's converter reads): load the model from a folder or pass {source_dir}",
                          source_dir=OptionRef("source_dir"))
    import json

    cfg = json.loads(model.config.to_json_string(use_diff=True))
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]  # as save_pretrained writes it
    with tempfile.TemporaryDirectory(prefix="lowbit-gguf-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        return plan_gguf(tmp, tensors=tensors, metadata=False)


def in_folder_order(tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """``tensors`` in the order of the source folder's safetensors (the order llama.cpp's converter
    reads a checkpoint in, and so the file's tensor order), the names it lacks after them; as given
    when the folder holds no safetensors."""
    from lowbit.files.folder import SafetensorsFolder

    try:
        order = SafetensorsFolder(folder)
    except FormatError:
        return tensors
    try:
        names = list(order)
    finally:
        order.close()
    first = {n: tensors[n] for n in names if n in tensors}
    return first | {n: t for n, t in tensors.items() if n not in first}


def linear_types(model: nn.Module, plan, types) -> dict[str, GgmlType | str]:
    """Linear module name -> the type the format gives its weight's GGUF tensor (GgmlType or
    ``F16``), for every ``nn.Linear`` (or ``GgmlLinear``) whose weight a row map carries;
    FormatError naming the tensor when one weight lands in tensors of different types."""
    from lowbit.formats.gguf.rowmap import RowMap

    linears = {f"{n}.weight": n for n, m in model.named_modules() if isinstance(m, (nn.Linear, GgmlLinear))}
    out: dict[str, GgmlType | str] = {}
    for t in plan.tensors:
        kind = types.get(t.name)
        if not isinstance(t, RowMap) or kind is None:
            continue
        for src in t.sources:
            n = linears.get(src)
            if n is None:
                continue
            if out.setdefault(n, kind) != kind:
                raise FormatError(f"GGUF: the rows of {src!r} go to tensors of types {out[n]} and {kind} "
                                  f"(e.g. {t.name!r}); one linear holds one GGML type")
    return out


@torch.no_grad()
def quantize_ggml(model: nn.Module, target: GgufTarget, *, source_dir: str | os.PathLike | None = None,
                  calibration=None) -> nn.Module:
    """Quantize ``model`` in place to the GGUF ``target`` (module docstring); returns it. Sets
    ``model.lowbit_gguf_target`` and ``model.lowbit_gguf_types`` (linear -> GGML type name, as
    ``lowbit.load`` of a GGUF file does). ``calibration``: a ``lowbit.gguf_calibrate.GgmlCalibration``
    (the importance matrix and GPTQ of ``quantize_gguf``; what the file's other tensors get is
    left on ``model.lowbit_gguf_calibrated`` for ``save_gguf``), or None: llama.cpp's reference rounding."""
    from lowbit.targets import set_submodule

    fmt = get_format(Format.GGUF)
    target = fmt.target(target)
    done = [n for n, m in model.named_modules() if isinstance(m, GgmlLinear) or hasattr(m, "scheme")]
    if done:
        raise QuantizationError(f"the model is already quantized (e.g. {done[0]!r}): lowbit.quantize works in place, "
                                f"so quantize a fresh float model")
    plan = _plan(model, source_folder(model, source_dir), metadata=isinstance(target, Mix))
    types = fmt.tensor_types(plan, target)
    kinds = linear_types(model, plan, types)
    held, calibrated = {}, None
    if calibration is not None:
        from lowbit.gguf_calibrate import calibrate

        held, calibrated = calibrate(model, plan, types, kinds, calibration)  # the float model's forward, first
    for name, kind in kinds.items():
        if not isinstance(kind, GgmlType):
            continue  # F16: no GGML block fits the row; the file rounds it to half precision
        lin = model.get_submodule(name)
        data = held[f"{name}.weight"][1] if calibration is not None else _encode(lin.weight, kind, name)
        set_submodule(model, name, GgmlLinear(data, kind, lin.bias, name=name))
    setattr(model, TARGET_ATTR, target)
    model.lowbit_gguf_calibrated = calibrated
    model.lowbit_gguf_types = {n: (k.name if isinstance(k, GgmlType) else "F16") for n, k in kinds.items()}
    return model


def _encode(weight: torch.Tensor, kind: GgmlType, name: str) -> torch.Tensor:
    from lowbit.formats.gguf.writer import encode_rows, float_weight

    return torch.from_numpy(encode_rows(float_weight(weight, f"{name}.weight"), kind, name))


def save_gguf(model: nn.Module, out: str | os.PathLike, *, tokenizer=None, source_dir: str | os.PathLike | None = None,
              overwrite: bool = False) -> Path:
    """``lowbit.save(model, out, format="gguf")``: the GGUF file of a model quantized in memory to a
    GGUF target (module docstring); returns its path. FormatError naming the option or tensor."""
    fmt = get_format(Format.GGUF)
    target = getattr(model, TARGET_ATTR, None)
    if target is None:
        raise FormatError("format 'gguf' writes a model quantized to a GGML type or mix in memory "
                          "(lowbit.quantize(model, 'q4_k')); this model holds none")
    if tokenizer is not None:
        raise FormatError("a GGUF file takes its tokenizer from the source folder, through llama.cpp's converter: "
                          "pass {source_dir} instead of {tokenizer}", source_dir=OptionRef("source_dir"),
                          tokenizer=OptionRef("tokenizer"))
    folder = source_folder(model, source_dir)
    if folder is None:
        raise FormatError("a GGUF file needs the model's source folder (config.json and the tokenizer files llama.cpp's "
                          "converter reads): load the model from a folder or pass {source_dir}",
                          source_dir=OptionRef("source_dir"))
    fmt.check_output(folder, out, overwrite)
    plan = _plan(model, folder, metadata=True)
    types = fmt.tensor_types(plan, target)
    held = {n: m for n, m in model.named_modules() if isinstance(m, GgmlLinear)}
    for name, kind in linear_types(model, plan, types).items():
        m = held.get(name)
        if m is not None and m.kind is not kind:
            raise FormatError(f"GGUF: {name!r} holds {m.kind.value} blocks, but format 'gguf' gives its tensor "
                              f"{kind if isinstance(kind, str) else kind.value} under {target.value}")
    encoded = {f"{n}.weight": (m.kind, m.weight_data) for n, m in held.items()}
    cal = getattr(model, "lowbit_gguf_calibrated", None)  # lowbit.gguf_calibrate.GgmlCalibrated
    if cal is None:
        fmt.write(plan, out, model_tensors(model), target, types, encoded=encoded)
    else:
        fmt.write(plan, out, model_tensors(model), target, types, encoded={**cal.encoded, **encoded},
                  importance=cal.importance, search=cal.search)
    return Path(out)
