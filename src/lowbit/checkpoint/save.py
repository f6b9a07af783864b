"""``lowbit.save(qmodel, out_dir, format=...)``: a complete, atomically written Hugging Face folder.

    lowbit.save(qmodel, "out/", format="lowbit" | "fake" | "compressed-tensors",
                tokenizer=None, source_dir=None, overwrite=False, max_shard_size=2 * 2**30)

The folder holds config.json (the model config plus ``quantization_config``), the weights as
safetensors (sharded with ``model.safetensors.index.json`` above ``max_shard_size`` bytes; the
``lowbit`` format names them ``lowbit-model*.safetensors`` instead, so that stock loaders such as
transformers fail on it rather than load uninitialised weights for its layers),
generation_config.json, and the tokenizer (``tokenizer.save_pretrained``) or the tokenizer and
generation files copied from ``source_dir`` (default: the folder the model was loaded from, when it
is a local folder). Everything is written to a temporary folder renamed at the end: a failed save
leaves nothing behind (a refused write, disk full or read-only, is an OutputError naming the path).
Tied input/output embeddings are written once. Mixture-of-experts models are written per expert
under their family's checkpoint names (``lowbit.moe.naming``); routers are listed in ``ignore``. The output folder's lock (lowbit.files.outlock) is
held while writing: a second save into the same folder at the same time is refused; an output that
is the source folder (or holds it) is refused (lowbit.files.outguard). A calibrated FP8 KV cache
(``model.lowbit_kv_cache``) is written as the format defines it (``lowbit.formats.kv_layout``:
``<attention>.k_scale``/``.v_scale`` and the config's ``kv_cache_scheme`` / ``kv_cache``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lowbit.modules.fake_linear import FakeQuantLinear
from lowbit.modules.ggml_linear import GgmlLinear
from lowbit.errors import FormatError, OptionRef
from lowbit.formats import Format, get_layout, static_scale_entry
from lowbit.formats.base import SHARED_SCALES
from lowbit.files.writer import CheckpointWriter
from lowbit.formats.base import Layout, dtype_name
from lowbit.formats.lowbit_layout import file_scale
from lowbit.kvcache.attention import kv_scales
from lowbit.files.outguard import check_not_source
from lowbit.modules import QuantLinear
from lowbit.moe import checkpoint_names, router_names
from lowbit.moe.naming import ignore_names
from lowbit.recipes.groups import config_groups


def model_dtype(model: nn.Module) -> torch.dtype:
    d = getattr(model, "dtype", None)
    if isinstance(d, torch.dtype) and d.is_floating_point:
        return d
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, FakeQuantLinear))}


def float_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def layer_scales(layers: dict[str, nn.Module]) -> dict[str, dict[str, torch.Tensor | None]]:
    """Each quantized layer's scales a format may need shared (``Layout.check_layers``)."""
    return {n: {a: getattr(m, a, None) for a in SHARED_SCALES} for n, m in layers.items()}


def _source_dir(model: nn.Module, source_dir: str | Path | None) -> Path | None:
    if source_dir is not None:
        return Path(source_dir)
    p = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if p and Path(str(p)).is_dir():
        return Path(str(p))
    return None


def config_dict(model: nn.Module, dtype: torch.dtype, qcfg: dict[str, Any], untie: bool) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise FormatError("lowbit.save needs a Hugging Face model (with .config) to write config.json")
    d = json.loads(cfg.to_json_string(use_diff=True))
    d.pop("quantization_config", None)
    d["dtype"] = dtype_name(dtype)
    d.pop("torch_dtype", None)
    if untie:
        d["tie_word_embeddings"] = False
    if not d.get("architectures"):
        d["architectures"] = [type(model).__name__]
    d["quantization_config"] = qcfg
    return d


def as_saved(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor as the folder stores it, in ``dtype``; other tensors (integer buffers) as
    they are."""
    return t.detach().to(dtype) if t.dtype.is_floating_point and t.dtype != dtype else t.detach()


def quantized_tensors(layers: dict[str, nn.Module], layout, dtype: torch.dtype
                      ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float | None]], list[str]]:
    """The tensors ``layout`` writes for the quantized linears ``layers`` (model names -> QuantLinear
    or FakeQuantLinear), their static input-scale entries (``static_scale_entry``), and the names
    of scales that ``dtype`` rounds (for ``_warn_rounded``). Model names: ``collect_tensors`` maps
    them to the family's checkpoint names."""
    tensors: dict[str, torch.Tensor] = {}
    static: dict[str, dict[str, float | None]] = {}
    lossy: list[str] = []
    for name, m in layers.items():
        if isinstance(m, FakeQuantLinear):
            tensors[f"{name}.weight"] = m.weight.detach().to(dtype)
            if m.bias is not None:
                tensors[f"{name}.bias"] = m.bias.detach().to(dtype)
        else:
            qw = m.weight_qtensor()
            t = layout.linear_tensors(name, qw, m.scheme, bias=m.bias, input_scale=m.input_scale,
                                      input_global_scale=m.input_global_scale, dtype=dtype)
            exact = {f"{name}.weight_scale": file_scale(qw.scale, m.scheme.weights), f"{name}.input_scale": m.input_scale}
            lossy += [k for k, src in exact.items() if k in t and src is not None and _rounded(t[k], src)]
            tensors.update(t)
        if m.input_scale is not None or m.input_global_scale is not None:
            static[name] = static_scale_entry(m.input_scale, m.input_global_scale)
    return tensors, static, lossy


def collect_tensors(model: nn.Module, checkpoint_format: Format | str, dtype: torch.dtype | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """(all tensors to write, quantization_config, whether the embeddings must be untied)."""
    checkpoint_format = Format.parse(checkpoint_format)
    layout = get_layout(checkpoint_format)
    dtype = dtype or model_dtype(model)
    layers = quantized_modules(model)
    ggml = next((n for n, m in model.named_modules() if isinstance(m, GgmlLinear)), None)
    if ggml is not None:
        raise FormatError(f"layer {ggml!r} holds llama.cpp's GGML blocks: only {{gguf}} holds them",
                          gguf=OptionRef("format", "gguf"))
    if not layers:
        if getattr(model, "lowbit_kv_cache", None) is not None:
            raise FormatError("the model has a KV cache but no quantized layers: saving a KV cache without a weight "
                              "scheme is not supported (quantize with a scheme and kv_cache)")
        raise FormatError("the model has no quantized layers (run lowbit.quantize first)")
    for s in dict.fromkeys(m.scheme for m in layers.values()):
        layout.check_scheme(s)
    layout.check_layers(layer_scales(layers))
    fake_loaded = [n for n, m in layers.items() if isinstance(m, FakeQuantLinear)]
    if fake_loaded and not layout.holds_dequantized:
        raise FormatError(f"layers such as {fake_loaded[0]!r} were loaded from a 'fake' checkpoint and hold "
                          "dequantized weights, not codes; they can only be saved with {fake}",
                          fake=OptionRef("format", "fake"))
    out_emb = getattr(model, "get_output_embeddings", lambda: None)()
    in_emb = getattr(model, "get_input_embeddings", lambda: None)()
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    untie = tied and any(m is out_emb for m in layers.values())

    tensors, static, lossy = quantized_tensors(layers, layout, dtype)
    warn_rounded("scales", lossy, dtype, layout)

    seen: dict[tuple[int, int, tuple], str] = {}
    for k, v in model.state_dict().items():
        if k.rpartition(".")[0] in layers:
            continue
        if tied and not untie and out_emb is not None and in_emb is not None and \
                v.data_ptr() == in_emb.weight.data_ptr() and k == _param_name(model, out_emb):
            continue  # tied output embedding: written once, as the input embedding
        key = (v.data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            v = v.clone()
        elif key is not None:
            seen[key] = k
        tensors[k] = as_saved(v, dtype)

    kv_cache = getattr(model, "lowbit_kv_cache", None)
    kv = kv_scales(model) if kv_cache is not None else {}
    kv_t = layout.kv_tensors(kv, dtype)
    warn_rounded("KV-cache scales", [k for k, t in kv_t.items()
                                      if _rounded(t, kv[k.rpartition(".")[0]][k.endswith("v_scale")].cpu())], dtype,
                 layout)
    tensors.update(kv_t)

    # the family's checkpoint names (Mixtral: block_sparse_moe.experts.{e}.w1 ...; most: unchanged)
    mt = getattr(getattr(model, "config", None), "model_type", None)
    ignore = float_linears(model) + router_names(model)
    disk = checkpoint_names(mt, list(tensors) + list(layers) + ignore)
    tensors = {disk[k]: v for k, v in tensors.items()}
    groups = config_groups({disk[n]: m.scheme for n, m in layers.items()})  # one order for every writer
    static = {disk[n]: v for n, v in static.items()}
    qcfg = layout.quantization_config_groups(groups, ignore_names(mt, ignore), static_scales=static)
    qcfg = layout.add_kv_config(qcfg, kv_cache, kv)
    return tensors, qcfg, untie


def _rounded(stored: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether a scale stored in a 16-bit float (compressed-tensors keeps some in the model dtype)
    lost bits against its float32 value."""
    return stored.dtype in (torch.bfloat16, torch.float16) and \
        not torch.equal(stored.to(torch.float32).reshape(exact.shape), exact.to(torch.float32))


def warn_rounded(what: str, names: list[str], dtype: torch.dtype, layout: Layout) -> None:
    """One warning for the scales ``layout`` stores in ``dtype`` that lost bits (``names``)."""
    if names:
        warnings.warn(f"{len(names)} {what} (e.g. {names[0]!r}) are not exactly representable in {dtype_name(dtype)}, "
                      f"the dtype the '{layout.format.value}' format stores them in; the file holds them rounded. "
                      f"Use the 'lowbit' format for a bit-exact checkpoint.", stacklevel=4)


def _param_name(model: nn.Module, module: nn.Module) -> str | None:
    for n, m in model.named_modules():
        if m is module:
            return f"{n}.weight"
    return None


def save(model: nn.Module, out_dir: str | Path, format: Format | str = Format.LOWBIT, *, tokenizer=None,
         source_dir: str | Path | None = None, overwrite: bool = False, max_shard_size: int = 2 * 2**30) -> Path:
    """Write ``model`` (quantized with lowbit) as a complete Hugging Face folder; returns its path.
    ``format="gguf"``: one GGUF file at ``out_dir`` for a model quantized in memory to a GGML type or
    mix (``lowbit.gguf_memory.save_gguf``; ``max_shard_size`` does not apply)."""
    checkpoint_format = Format.parse(format)
    if checkpoint_format is Format.GGUF:
        from lowbit.gguf_memory import save_gguf

        return save_gguf(model, out_dir, tokenizer=tokenizer, source_dir=source_dir, overwrite=overwrite)
    dtype = model_dtype(model)
    tensors, qcfg, untie = collect_tensors(model, checkpoint_format, dtype)
    config = config_dict(model, dtype, qcfg, untie)
    src = _source_dir(model, source_dir)
    if src is not None:
        check_not_source(src, out_dir)  # never replace the folder the model was loaded from
    with CheckpointWriter(out_dir, overwrite=overwrite, max_shard_bytes=max_shard_size,
                          weights_stem=get_layout(checkpoint_format).weights_stem) as w:
        w.add_tensors(tensors)
        write_side_files(w, model, config, src, tokenizer)
    return Path(out_dir)


def write_side_files(w: CheckpointWriter, model: nn.Module, config: dict[str, Any], source: Path | None,
                     tokenizer) -> None:
    """Everything of a saved folder but the weights: config.json, the generation config, the
    source folder's tokenizer and other auxiliary files, then ``tokenizer`` (when given) over them."""
    w.write_json("config.json", config)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        w.write_json("generation_config.json", json.loads(gen.to_json_string(use_diff=True)))
    w.copy_aux_files(source)
    if tokenizer is not None:
        w.save_tokenizer(tokenizer)
