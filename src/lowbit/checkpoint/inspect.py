"""What a checkpoint folder holds, and what is wrong with it (``lowbit inspect PATH``).

    report = inspect_checkpoint(path)     # a JSON-ready dict; never raises for a bad folder
                                          # that has a readable config.json: problems are listed

Keys: path, format, source, dtype, groups (scheme name, weights, input activations, every
QuantSpec field, layer count, targets), layers (name -> scheme name), ignored (Linears left in
float), size_on_disk (bytes of the weight files: ``*.safetensors``), float_size (the same model's parameters in its
float dtype, tied weights once), ratio, experts (MoE: per experts block, how many experts it has and
how many of them are quantized), kv_cache (None, or the calibrated FP8 KV cache: scheme, spec,
attention modules and their k_scale/v_scale), inconsistencies (one line each: file, tensor, what).

The model's layers come from its config.json built on the meta device (no memory, no weights);
every quantized layer is read through its layout exactly as lowbit.load does, so whatever would
make loading fail is reported here, all of it, not just the first problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lowbit.errors import FormatError, LowbitError
from lowbit.formats.base import parse_dtype
from lowbit.formats.detect import parse_quantization_config
from lowbit.files.folder import FLOAT_DTYPE_CODES, SafetensorsFolder, read_config
from lowbit.fusion import fused_groups
from lowbit.checkpoint.load import model_view
from lowbit.moe import expert_blocks


def _meta_model(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    from lowbit.formats import get_layout

    path = Path(path)
    config = read_config(path)
    checkpoint_format, parsed = parse_quantization_config(config)
    problems: list[str] = []
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        dtype = parse_dtype(dtype_name, "config.json dtype")
    except FormatError as e:
        problems.append(str(e))
        dtype = torch.float32
    report: dict[str, Any] = {
        "path": str(path), "format": checkpoint_format.value, "source": parsed.source, "dtype": str(dtype).removeprefix("torch."),
        "groups": [], "layers": {}, "ignored": [], "size_on_disk": sum(p.stat().st_size for p in _weight_files(path)),
        "float_size": None, "ratio": None, "inconsistencies": problems,
    }
    if parsed.extra:
        report["details"] = {k: v for k, v in parsed.extra.items() if k != "formats"}
    try:
        folder = SafetensorsFolder(path)
    except FormatError as e:
        problems.append(str(e))
        folder = None
    layout = get_layout(checkpoint_format)
    native = layout.reads(config["quantization_config"])  # written by lowbit, not auto-round
    if folder is not None and folder.files is not None and native and folder.files.stem != layout.weights_stem:
        problems.append(f"{folder.files.single if folder.index_path is None else folder.index_path.name}: "
                        f"'{checkpoint_format.value}' format weights belong in {layout.weights_stem}*.safetensors "
                        f"files; under these names stock loaders (transformers) would {layout.misnamed_weights}"
                        f" (re-save it with lowbit.save)")
    try:
        model = _meta_model(path)
    except Exception as e:  # transformers raises many kinds for unknown configs
        problems.append(f"config.json: transformers cannot build the model ({type(e).__name__}: {e}); "
                        f"layer checks skipped")
        model = None
    counts: dict[str, int] = {}
    shapes: dict[str, tuple[int, int]] = {}
    schemes_of: dict[str, Any] = {}
    if model is not None:
        folder, parsed, disk = model_view(model, folder, parsed)  # as lowbit.load reads it (MoE split)
        out_emb = model.get_output_embeddings()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        seen: set[int] = set()
        n_float = 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n_float += p.numel()
        report["float_size"] = n_float * torch.empty((), dtype=dtype).element_size()
        if report["float_size"]:
            report["ratio"] = round(report["size_on_disk"] / report["float_size"], 4)
        quantized: dict[str, Any] = {}
        unreadable: set[str] = set()  # quantized layers whose tensors could not be read (reported)
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            try:
                scheme = parsed.scheme_for(disk[name], is_output_embedding=mod is out_emb)
            except LowbitError as e:
                problems.append(str(e))
                continue
            if scheme is None:
                report["ignored"].append(name)
                if folder is not None and get_layout(checkpoint_format).quant_suffixes:
                    stray = [f"{name}.{s}" for s in get_layout(checkpoint_format).quant_suffixes if f"{name}.{s}" in folder]
                    if stray:
                        problems.append(f"tensor {folder.describe(stray[0])} quantizes {name!r}, which the config "
                                        f"leaves in float")
                elif folder is not None and f"{name}.weight" not in folder and not (tied and mod is out_emb):
                    problems.append(f"tensor {name + '.weight'!r} is missing")
                continue
            report["layers"][name] = scheme.name
            counts[scheme.name] = counts.get(scheme.name, 0) + 1
            shapes[name], schemes_of[name] = (mod.out_features, mod.in_features), scheme
            if folder is None:
                continue
            try:
                r = parsed.layout_for(scheme).read_linear(name, folder, scheme, dtype, config=parsed,
                                                        shape=(mod.out_features, mod.in_features))
            except LowbitError as e:
                problems.append(str(e))
                unreadable.add(name)
                continue
            got = tuple(r.qweight.codes.shape) if r.qweight is not None else tuple(r.weight.shape)
            if got != (mod.out_features, mod.in_features):
                problems.append(f"layer {name!r}: stored weight has shape {got}, the model config says "
                                f"{(mod.out_features, mod.in_features)}")
            quantized[name] = r
        for group in fused_groups(list(quantized)):
            for attr in ("input_scale", "input_global_scale"):
                vals = [getattr(quantized[n], attr) for n in group]
                if len(group) > 1 and vals[0] is not None and any(v is None or not torch.equal(v, vals[0]) for v in vals):
                    problems.append(f"layers {group} are fused by runtimes but their {attr} values differ")
            gs = [quantized[n].qweight.global_scale if quantized[n].qweight is not None else None for n in group]
            if len(group) > 1 and gs[0] is not None and any(g is None or not torch.equal(g, gs[0]) for g in gs):
                problems.append(f"layers {group} are fused by runtimes but their weight_global_scale values differ")
        if folder is not None:
            state = model.state_dict()
            expected = {k for k in state if k.rpartition(".")[0] not in quantized.keys() | unreadable}
            for k in sorted(expected):
                if k not in folder and not (tied and out_emb is not None and k == _out_key(model, out_emb)):
                    if k.rsplit(".", 1)[0] in report["ignored"] and k.endswith(".weight"):
                        continue  # already reported above
                    problems.append(f"tensor {k!r} is missing")
                elif k in folder:
                    st_dtype, st_shape, _ = folder.info(k)
                    if tuple(st_shape) != tuple(state[k].shape):
                        problems.append(f"tensor {folder.describe(k)} has shape {tuple(st_shape)}, the model config "
                                        f"says {tuple(state[k].shape)}")
                    elif state[k].dtype.is_floating_point and st_dtype not in FLOAT_DTYPE_CODES:
                        problems.append(f"tensor {folder.describe(k)} has dtype {st_dtype}, expected a float dtype "
                                        f"({', '.join(sorted(FLOAT_DTYPE_CODES))})")
    from lowbit.recipes.weight_bits import average_bits

    report["average_bits"] = average_bits(shapes, schemes_of) if schemes_of else None  # codes + scales
    report["kv_cache"] = _kv_report(parsed, folder, model, problems)
    if model is not None:
        report["experts"] = {
            name: {"experts": len(block),
                   "quantized": sum(1 for e in range(len(block))
                                    if any(f"{name}.{e}.{c}" in report["layers"] for c, _ in block[e].named_children()))}
            for name, block in expert_blocks(model).items()}
    for scheme, targets in parsed.groups:
        report["groups"].append({
            "scheme": scheme.name, "targets": targets, "layers": counts.get(scheme.name, 0),
            "weights": scheme.weights.describe(),
            "input_activations": None if scheme.input_activations is None else
            f"{scheme.input_activations.describe()}, {scheme.input_activations.dynamic.value}",
            "spec": scheme.to_dict(),
        })
    if folder is not None and folder.index_path is not None:
        import json

        try:
            declared = json.loads(folder.index_path.read_text()).get("metadata", {}).get("total_size")
        except Exception:
            declared = None
        real = sum(folder.nbytes(k) for k in folder)
        if declared is not None and declared != real:
            problems.append(f"{folder.index_path.name}: total_size {declared} differs from the tensors' {real} bytes")
    return report


def _kv_report(parsed, folder, model, problems: list[str]) -> dict[str, Any] | None:
    """The KV-cache entry of the report, its scales read as lowbit.load reads them (problems listed);
    KV-cache scale tensors in a folder whose config has no KV cache are listed as problems."""
    from lowbit.formats import get_layout
    from lowbit.formats.kv_layout import KV_TENSORS
    from lowbit.kvcache.spec import KV_SPEC
    from lowbit.kvcache.attention import attention_modules

    names = list(attention_modules(model)) if model is not None else []
    if parsed.kv_cache is None:
        stray = sorted(k for k in (folder or ()) if k.rpartition(".")[2] in KV_TENSORS)
        if stray:
            problems.append(f"tensor {folder.describe(stray[0])} (and {len(stray) - 1} more) is a KV-cache scale but "
                            f"the config has no KV-cache scheme (kv_cache_scheme / kv_cache)")
        return None
    scales: dict[str, dict[str, float]] = {}
    if folder is not None and model is not None:
        try:
            read = get_layout(parsed.format).read_kv_scales(parsed, folder, names)
            scales = {n: {"k_scale": float(k[0]), "v_scale": float(v[0])} for n, (k, v) in read.items()}
        except LowbitError as e:
            problems.append(str(e))
    return {"scheme": parsed.kv_cache, "description": f"{KV_SPEC.describe()}, {KV_SPEC.dynamic.value}",
            "attention_modules": len(names), "spec": KV_SPEC.to_dict(), "scales": scales}


def _out_key(model, out_emb) -> str | None:
    for n, m in model.named_modules():
        if m is out_emb:
            return f"{n}.weight"
    return None
