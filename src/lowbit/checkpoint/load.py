"""``lowbit.load(path, backend="auto")``: rebuild a quantized model from a checkpoint folder.

    model = lowbit.load("out/")                       # format detected from config.json
    model = lowbit.load("out/", backend="reference", dtype=None)

Reads lowbit, fake and compressed-tensors folders (lowbit's own and llm-compressor's) and
auto-round folders. The model class comes from config.json (transformers ``AutoModelForCausalLM``,
built without random initialisation); every Linear the config quantizes becomes a QuantLinear
(or, for ``fake`` folders, a FakeQuantLinear) holding exactly the stored codes and scales; every
other tensor is loaded as stored. A model that prepares its own weights in place in its first
forward (RWKV's rescaling) runs that forward before the tensors are read in, as it had before it
was quantized (``lowbit.checkpoint.prepare``). Mixture-of-experts models are rebuilt with their experts split
(``lowbit.moe.split_experts``) and read per expert, under the family's checkpoint names
(``lowbit.moe.naming``: Mixtral's legacy ``block_sparse_moe.experts.{e}.w1/w2/w3`` too). Anything inconsistent (a missing tensor or scale, a shape or
dtype that does not match the config, quantized tensors on a layer the config leaves in float,
a damaged shard) is a FormatError naming the file, tensor or option. A folder with a calibrated
FP8 KV cache (``lowbit.formats.kv_layout``) gets its ``k_scale``/``v_scale`` on every attention
module and the lowbit attention wrapper (``lowbit.kvcache.attention``): its forward QDQs K and V.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn

from lowbit.checkpoint.prepare import prepare
from lowbit.modules.fake_linear import FakeQuantLinear
from lowbit.errors import FormatError, LowbitError
from lowbit.formats import get_layout, parse_quantization_config
from lowbit.files.folder import SafetensorsFolder, read_config
from lowbit.formats.base import FLOAT_DTYPES, QUANT_SUFFIXES, ParsedConfig, parse_dtype
from lowbit.kvcache.attention import attach, attention_modules
from lowbit.modules import QuantLinear
from lowbit.hostcpu import cpu_flags
from lowbit.quant.serving import ServingNumerics, host_isa
from lowbit.linearize import linearize
from lowbit.renames import folder_renames
from lowbit.moe import model_names
from lowbit.moe.naming import module_checkpoint_names
from lowbit.targets import set_submodule


def _config_dtype(config: dict) -> torch.dtype:
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None:
            return parse_dtype(config[key], f"config.json {key!r}")
    return torch.float32


def build_empty_model(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model class from config.json, float, without random initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unknown configs
        raise FormatError(f"{str(path / 'config.json')!r}: transformers cannot build a config from it: {e}") from None
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval()


def model_view(model: nn.Module, folder: SafetensorsFolder | None, parsed: ParsedConfig
               ) -> tuple[SafetensorsFolder | None, ParsedConfig, dict[str, str]]:
    """Split ``model``'s MoE experts (``lowbit.moe.split_experts``, as the files store them) and
    return the folder and config under the model's names (the family's checkpoint names, e.g.
    Mixtral's legacy ones, mapped by ``lowbit.moe.naming``) with ``{linear: its name in the
    config}``. The one view lowbit.load and lowbit inspect read a folder through."""
    linearize(model)
    mt = getattr(model.config, "model_type", None)
    modules: dict[str, str] = {}  # folder module -> model module, where transformers renames (lowbit.renames)
    if folder is not None:
        names = model_names(mt, list(folder))
        held = {n for n, _ in model.named_modules()}  # as transformers: a key renamed to no module keeps its name
        names = {k: k if n.rpartition(".")[0] not in held and k.rpartition(".")[0] in held else n
                 for k, n in names.items()}  # (DeepSeek-V4's ".norm." -> ".kv_norm." would take model.norm)
        renames = folder_renames(model, names.values())
        modules = {k.rpartition(".")[0]: v.rpartition(".")[0] for k, v in renames.items()}
        folder = folder.with_names({k: renames.get(n, n) for k, n in names.items()})
    if parsed.static_scales:  # layer names
        parsed = dataclasses.replace(parsed, static_scales={
            modules.get(m, m): v for m, v in ((model_names(mt, [k])[k], v) for k, v in parsed.static_scales.items())})
    as_folder = {v: k for k, v in modules.items()}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return folder, parsed, {n: as_folder.get(n, d) for n, d in module_checkpoint_names(mt, linears).items()}


def _say_if_another_host(numerics: ServingNumerics) -> None:
    """A warning when ``numerics`` are an engine's on another kind of host than this one (they stay
    the numerics asked for: the model may be served elsewhere)."""
    here = host_isa(cpu_flags())
    if numerics.isa is None or here is None or here is numerics.isa:
        return
    warnings.warn(f"lowbit: numerics {numerics.value!r} are vLLM-CPU's on {numerics.isa.value.upper()} hosts; "
                  f"this host is {here.value.upper()}, where vLLM computes {ServingNumerics.for_host(here).value!r} "
                  f"(bench/serve/RESULTS-serve.md)", stacklevel=3)


def load(path: str | Path, backend: str = "auto", *, dtype: torch.dtype | None = None,
         numerics: ServingNumerics = ServingNumerics.LOWBIT) -> nn.Module:
    """Load a quantized checkpoint folder as a model with lowbit modules, backend set; or a GGUF
    file with its GGML blocks kept (``lowbit.formats.gguf.read.load_gguf``: numerics LOWBIT or
    LLAMA_CPP_CPU, which only GGUF files take).

    ``numerics``: LOWBIT computes what the folder means (``backend``, in ``dtype`` or the config's);
    an engine's (``ServingNumerics.VLLM_CPU``) runs the model in that engine's dtype with the backend
    that reproduces its kernels (lowbit.backends.use_numerics) and, for the model types
    lowbit.modules.engine_layers covers, the engine's arithmetic outside the linears too (norms,
    residual adds, RoPE, attention; another model warns that only its linears are the engine's):
    ``backend`` must stay "auto" and ``dtype`` None or the engine's, and a layer the emulation does
    not cover is a LowbitError."""
    path = Path(path)
    if not isinstance(numerics, ServingNumerics):
        raise LowbitError(f"numerics must be a ServingNumerics ({', '.join(n.value for n in ServingNumerics)}), "
                          f"got {numerics!r}")
    if path.is_file():
        from lowbit.formats.gguf import is_gguf_file
        from lowbit.formats.gguf.read import load_gguf

        if not is_gguf_file(path):  # a *.gguf file that is not GGUF: its own FormatError
            raise FormatError(f"{str(path)!r} is a file but not a GGUF file; lowbit.load reads GGUF files and "
                              f"checkpoint folders")
        if backend != "auto" or dtype not in (None, torch.float32):
            raise LowbitError(f"a GGUF file runs its GGML blocks in float32: backend {backend!r} and dtype {dtype} "
                              f"do not apply")
        return load_gguf(path, numerics)
    if numerics is ServingNumerics.LLAMA_CPP_CPU:
        raise LowbitError(f"numerics {numerics.value!r} are llama.cpp's on a GGUF file; {str(path)!r} is a folder")
    if numerics is not ServingNumerics.LOWBIT:
        if backend != "auto":
            raise LowbitError(f"numerics {numerics.value!r} chooses the backend itself; backend {backend!r} "
                              f"cannot be combined with it")
        if dtype not in (None, numerics.model_dtype):
            raise LowbitError(f"numerics {numerics.value!r} runs the model in {numerics.model_dtype}, not {dtype}")
        dtype = numerics.model_dtype
        _say_if_another_host(numerics)
    config = read_config(path)
    checkpoint_format, parsed = parse_quantization_config(config)
    folder = SafetensorsFolder(path)
    dtype = dtype or _config_dtype(config)
    model = build_empty_model(path, dtype)
    prepare(model)  # a model that prepares its weights in its first forward (RWKV): as when it was quantized
    folder, parsed, disk = model_view(model, folder, parsed)
    consumed: set[str] = set()
    out_emb = getattr(model, "get_output_embeddings", lambda: None)()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    by_parent: dict[str, list[str]] = {}
    for k in folder:
        by_parent.setdefault(k.rpartition(".")[0], []).append(k)
    for name, lin in linears:
        scheme = parsed.scheme_for(disk[name], is_output_embedding=lin is out_emb)
        if scheme is None:
            stray = [f"{name}.{s}" for s in get_layout(checkpoint_format).quant_suffixes if f"{name}.{s}" in folder]
            if stray:
                raise FormatError(f"tensor {folder.describe(stray[0])} quantizes layer {name!r}, which the config "
                                  f"leaves in float (listed in 'ignore' or not targeted)")
            continue
        if lin is out_emb and getattr(model.config, "tie_word_embeddings", False) and name not in by_parent:
            raise FormatError(f"layer {name!r} is quantized by the config but its weights are tied to the input "
                              f"embeddings and not stored")
        layout = parsed.layout_for(scheme)
        rec = _Recorder(folder)
        r = layout.read_linear(name, rec, scheme, dtype, config=parsed, shape=(lin.out_features, lin.in_features))
        scheme = r.scheme or scheme  # what the stored tensors say the layer runs under
        leftover = [k for k in by_parent.get(name, ()) if k not in rec.used]
        if leftover:
            raise FormatError(f"tensor {folder.describe(leftover[0])} does not belong to layer {name!r} under its "
                              f"scheme {scheme.name} ({layout.format.value}): config and tensors disagree")
        want = (lin.out_features, lin.in_features)
        got = tuple(r.qweight.codes.shape) if r.qweight is not None else tuple(r.weight.shape)
        if got != want:
            raise FormatError(f"layer {name!r}: stored weight has shape {got}, the model config says {want} "
                              f"(in {folder.describe(_weight_key(folder, name))})")
        if (r.bias is None) != (lin.bias is None):
            raise FormatError(f"layer {name!r}: the model {'has' if lin.bias is not None else 'has no'} bias but "
                              f"tensor {name + '.bias'!r} is {'missing' if r.bias is None else 'present'}")
        if r.qweight is not None:
            mod = QuantLinear.from_quantized(r.qweight, scheme, r.bias, input_scale=r.input_scale,
                                             input_global_scale=r.input_global_scale, name=name, dtype=dtype)
        else:
            mod = FakeQuantLinear(r.weight.to(dtype), None if r.bias is None else r.bias.to(dtype), scheme,
                                  name=name, input_scale=r.input_scale, input_global_scale=r.input_global_scale)
        set_submodule(model, name, mod)
        consumed.update(rec.used)
    kv = {}
    if parsed.kv_cache is not None:
        rec = _Recorder(folder)
        kv = get_layout(parsed.format).read_kv_scales(parsed, rec, list(attention_modules(model)))
        consumed.update(rec.used)
    _load_rest(model, folder, consumed, dtype, parsed)
    if parsed.kv_cache is not None:
        attach(model, kv, parsed.kv_cache)  # evaluation QDQs K and V as vLLM's FP8 cache does
    model.lowbit_format = checkpoint_format  # where it came from (for inspection and re-saving)
    model.lowbit_source = parsed.source
    from lowbit.backends import use_backend, use_numerics

    if numerics is ServingNumerics.LOWBIT:
        use_backend(model, backend)
    else:
        use_numerics(model, numerics)
        from lowbit.modules.engine_layers import use_engine_model_ops

        why = use_engine_model_ops(model, numerics)
        if why is not None:
            warnings.warn(f"numerics {numerics.value!r}: the ops outside the linears stay transformers' bf16 ones "
                          f"for {why}; only the linears reproduce the engine", stacklevel=2)
    return model


class _Recorder(Mapping):
    """A view of the folder that records which tensors a layout read."""

    def __init__(self, folder: SafetensorsFolder) -> None:
        self.folder = folder
        self.used: set[str] = set()

    def __contains__(self, k: object) -> bool:
        return k in self.folder

    def __getitem__(self, k: str) -> torch.Tensor:
        t = self.folder[k]
        self.used.add(k)
        return t

    def __iter__(self):
        return iter(self.folder)

    def __len__(self) -> int:
        return len(self.folder)

    def describe(self, k: str) -> str:
        return self.folder.describe(k)


def _weight_key(folder, name: str) -> str:
    for s in ("weight", "weight_packed", "weight_codes", "qweight"):
        if f"{name}.{s}" in folder:
            return f"{name}.{s}"
    return name


def _load_rest(model: nn.Module, folder: SafetensorsFolder, consumed: set[str], dtype: torch.dtype,
               parsed: ParsedConfig) -> None:
    quant = {n for n, m in model.named_modules() if isinstance(m, (QuantLinear, FakeQuantLinear))}
    expected = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quant}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = getattr(model, "get_output_embeddings", lambda: None)()
    out_key = next((f"{n}.weight" for n, m in model.named_modules() if m is out), None) if out is not None else None
    sd = {}
    for k, ref in expected.items():
        if k not in folder:
            if tied and k == out_key:
                continue
            raise FormatError(f"tensor {k!r} is missing from {str(folder.path)!r} (the model config needs it)")
        t = folder[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise FormatError(f"tensor {folder.describe(k)} has shape {tuple(t.shape)}, the model config says "
                              f"{tuple(ref.shape)}")
        if t.dtype.is_floating_point != ref.dtype.is_floating_point or \
                (ref.dtype.is_floating_point and t.dtype not in FLOAT_DTYPES):  # no FP8 cast in silently
            raise FormatError(f"tensor {folder.describe(k)} has dtype {t.dtype}, expected {ref.dtype} "
                              f"(or another of {', '.join(str(d) for d in FLOAT_DTYPES)})")
        sd[k] = t.to(ref.dtype)
        consumed.add(k)
    model.load_state_dict(sd, strict=False, assign=True)
    if tied:
        model.tie_weights()
    extra = sorted(k for k in folder if k not in consumed)
    if extra:
        bad = [k for k in extra if k.rsplit(".", 1)[-1] in QUANT_SUFFIXES]
        if bad:
            raise FormatError(f"tensor {folder.describe(bad[0])} (and {len(bad) - 1} more) belongs to no quantized "
                              f"layer of the config")
        warnings.warn(f"{len(extra)} tensors in {str(folder.path)!r} are not used by the model "
                      f"(e.g. {extra[0]!r})", stacklevel=3)
