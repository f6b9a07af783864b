"""What to do with every tensor of a checkpoint, decided from config.json, names and shapes.

Exact rules, never substring matches:
- A linear weight is a 2-D tensor named ``<module>.weight`` whose module is not an embedding
  (last name component in INPUT_EMBEDDING_COMPONENTS), not the output embedding (last
  component in OUTPUT_EMBEDDING_COMPONENTS or the whole name in OUTPUT_EMBEDDING_NAMES, outside
  any numbered block), not an unnamed top-level [vocab_size, ...] table, and not excluded by
  lowbit.targets.is_excluded_name (MoE routers, non-text towers, ``ignore`` patterns): the same
  set lowbit.targets.quantizable_linears finds on the built model.
- Fused expert tensors of the families in ``lowbit.moe.FUSED_ON_DISK`` (gpt-oss's
  ``experts.gate_up_proj`` [E, H, 2I], ``down_proj``, their biases) are split per expert as the
  in-memory path splits them (``lowbit.moe.slices``): expert e's linears are quantized as
  ``<block>.experts.{e}.gate_proj`` ..., their biases written as ``...bias``; so are fused experts
  stored as the model holds them (under its name, or one transformers only renames: Granite's
  ``input_linear``, ``lowbit.renames.load_names``), by the layout of the experts module of the model
  built from config.json on the meta device (``lowbit.moe.layouts``), and weighted shared experts
  stored one 3-D tensor per projection (Inkling's ``shared_experts.gate_proj`` ...,
  ``lowbit.moe.weighted_shared``) as ``<module>.{e}.<proj>``. Other fused 3-D expert
  tensors are refused, never copied in float silently. gpt-oss's own MXFP4
  experts (``quant_method: "mxfp4"``: ``*_blocks`` / ``*_scales``, lowbit.modelfree.mxfp4_source)
  are dequantized one expert at a time and quantized the same way.
- Linears the model's forward sets apart in memory (read without a call, such as Mamba's
  ``dt_proj``; routers found by their top-k; coefficient linears) are kept in float as in memory,
  read from the forward of the model built from config.json on the meta device
  (``lowbit.modelfree.meta_survey``; a forward that cannot run there: quantized by name).
- Everything else (norms, biases, embeddings, lm_head unless asked, routers, towers) is copied
  unchanged. An FP8 source is refused for an FP8 block target (fp8-block: it would round its FP8
  weights twice); for other targets FP8 sources are dequantized to the model dtype first (``weight_scale_inv``, found
  through the index in whatever shard holds it); their scales are not written.
- Tied embeddings: a source that stores lm_head.weight next to a tied embedding has it dropped
  (transformers ties it again on load); with ``include_lm_head`` the head is quantized from
  its own tensor (or from the embedding when the source stores only that) and the output
  config says the embeddings are no longer tied.
"""

from __future__ import annotations

from typing import Any, Iterable

from lowbit.errors import FormatError, QuantizationError
from lowbit.fusion import fused_groups
from lowbit.files.tensors import TensorInfo
from lowbit.modelfree.meta_survey import set_apart
from lowbit.modelfree.mxfp4_source import BLOCKS, SCALES
from lowbit.modelfree.plan_types import ExpertPart, Item, Kind, Plan, Source, Survey
from lowbit.modelfree.source_config import check_fp8_scale, source_fp8_block, source_mxfp4_experts
from lowbit.modelfree.source import FLOAT_SOURCES, FP8_SOURCES, Checkpoint
from lowbit.renames import load_names
from lowbit.moe.layouts import fused_layouts
from lowbit.moe import FUSED_ON_DISK, FusedLayout, Proj
from lowbit.moe.naming import FUSED_BIASES, FUSED_WEIGHTS
from lowbit.quant import num_groups
from lowbit.recipes.resolve import Assignment
from lowbit.numerics import FormatName
from lowbit.schemes import Granularity, Scheme
from lowbit.targets import is_excluded_name

INPUT_EMBEDDING_COMPONENTS = frozenset({
    "embed_tokens", "wte", "wpe", "word_embeddings", "position_embeddings", "token_type_embeddings",
    "embed_positions", "tok_embeddings", "embed_in", "embeddings", "shared", "relative_attention_bias",
})
OUTPUT_EMBEDDING_COMPONENTS = frozenset({"lm_head", "embed_out"})
OUTPUT_EMBEDDING_NAMES = frozenset({"output"})  # InternLM2's top-level head; never "*.output.*"
# architectures whose "linear" weights are transformers Conv1D ([in, out], not nn.Linear)
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
SCALE_INV = "weight_scale_inv"
FP8_DROPPED = ("input_scale", "activation_scale")  # static FP8 activation scales of the source


def _is_block_index(part: str) -> bool:
    return part.isdigit()


FUSED_EXPERT_LEAVES = frozenset({"gate_up_proj", "up_proj", "down_proj"})


def _is_fused_experts(module: str, leaf: str) -> bool:
    """A fused experts tensor as transformers writes it (``<block>.experts.gate_up_proj``), or a
    3-D ``.weight`` under an ``experts`` module."""
    parts = module.split(".")
    return (parts[-1] == "experts" and leaf in FUSED_EXPERT_LEAVES) or (leaf == "weight" and "experts" in parts)


def classify_weight(module: str, shape: tuple[int, ...], vocab_size: int | None) -> str:
    """'embedding', 'head' or 'linear' for a 2-D ``<module>.weight`` (before exclusions)."""
    parts = module.split(".")
    in_block = any(_is_block_index(p) for p in parts)
    if parts[-1] in INPUT_EMBEDDING_COMPONENTS:
        return "embedding"
    if not in_block and (parts[-1] in OUTPUT_EMBEDDING_COMPONENTS or module in OUTPUT_EMBEDDING_NAMES):
        return "head"
    if not in_block and vocab_size is not None and shape[0] == vocab_size:
        return "embedding"  # an unnamed top-level vocabulary table: never quantized silently
    return "linear"


def make_plan(ckpt: Checkpoint, assign: Assignment | None, ignore: Iterable[str] = (),
              include_lm_head: bool = False) -> Plan:
    """The plan of every tensor (see the module's docstring). ``assign``: the scheme of every
    module the plan quantizes (``Assignment.scheme_for``: one scheme for all is
    ``Assignment.for_all``; a recipe's gives each module its own: lowbit.modelfree.mixed, which
    surveys once and keeps the others in float with ``Survey.keep_float``); or None: only which
    modules are quantized (``quantized``, ``ignored``), with no check that depends on a scheme."""
    return plan_of(survey(ckpt, ignore, include_lm_head), assign)


def survey(ckpt: Checkpoint, ignore: Iterable[str] = (), include_lm_head: bool = False) -> Survey:
    """Every tensor's kind and the modules quantized, without a scheme (``make_plan``)."""
    ignore = list(ignore) + list(set_apart(ckpt.root) or ())  # what the model's forward sets apart (meta_survey)
    model_type = ckpt.get("model_type")
    if model_type in CONV1D_MODEL_TYPES:
        raise FormatError(f"{ckpt.root}: model_type {model_type!r} stores its projections as Conv1D [in, out], "
                          f"not linear weights; model-free quantization does not support it")
    is_fp8, block = source_fp8_block(ckpt)
    is_mx = source_mxfp4_experts(ckpt)
    mx_of: dict[str, TensorInfo] = {}  # MXFP4 blocks -> their scales
    vocab = ckpt.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) else None
    tied_cfg = ckpt.get("tie_word_embeddings")
    tensors = ckpt.tensors

    kinds: dict[str, Kind] = {}
    module_of: dict[str, str] = {}
    scale_of: dict[str, TensorInfo] = {}
    quantized: list[str] = []
    expanded: dict[str, list[tuple[Kind, str, ExpertPart]]] = {}  # fused tensor -> its experts' parts
    parts_of: dict[str, tuple[TensorInfo, ExpertPart]] = {}      # expert linear -> its fused source
    ignored: list[str] = []

    def expand(module: str, info: TensorInfo, leaf: str, layout: FusedLayout, bias: bool) -> list:
        """The per-expert parts of a fused tensor: (kind, output name or linear, part) each; of a
        linear applied per input group (``layout.row_groups``): its group linears ``<module>.<g>``."""
        out = []
        projs = (Proj(leaf),) if layout.separate else (Proj.DOWN,) if leaf.startswith("down") or layout.row_groups \
            else (Proj.GATE, Proj.UP) if layout.has_gate else (Proj.UP,)
        count = layout.row_groups or info.shape[0]
        for e in range(count):
            for pr in projs:
                lin = f"{module}.{e}" if layout.row_groups else f"{module}.{e}.{pr.value}"
                part = ExpertPart(e, pr, layout, count)
                if bias:
                    out.append((Kind.COPY, f"{lin}.bias", part))
                elif is_excluded_name(lin, ignore):
                    out.append((Kind.COPY, f"{lin}.weight", part))
                    ignored.append(lin)
                else:
                    out.append((Kind.QUANTIZE, lin, part))
                    parts_of[lin] = (info, part)
                    quantized.append(lin)
        return out

    heads: list[str] = []
    embeddings: list[str] = []
    layouts = {} if FUSED_ON_DISK.get(model_type) or is_mx else fused_layouts(ckpt.root)  # lowbit.moe.layouts
    renamed = load_names(model_type, list(tensors))  # the names transformers loads them as (lowbit.renames)
    for name in sorted(tensors):
        info = tensors[name]
        module, _, leaf = name.rpartition(".")
        if leaf == SCALE_INV:
            if not is_fp8:
                raise FormatError(f"{info.shard}: tensor {name!r} is an FP8 block scale, but config.json has no "
                                  f"'fp8' quantization_config")
            w = tensors.get(f"{module}.weight")
            if w is None:
                raise FormatError(f"{info.shard}: {name} has no matching {module}.weight in the checkpoint")
            check_fp8_scale(w, info, block)
            kinds[name] = Kind.DROP
            scale_of[w.name] = info
            continue
        if is_fp8 and leaf in FP8_DROPPED and f"{module}.{SCALE_INV}" in tensors:
            kinds[name] = Kind.DROP
            continue
        if info.dtype in FP8_SOURCES and f"{module}.{SCALE_INV}" not in tensors:
            raise FormatError(f"{info.shard}: FP8 tensor {name!r} has no {module}.{SCALE_INV} anywhere in the "
                              f"checkpoint (the index names none)")
        fused = FUSED_ON_DISK.get(model_type)
        if is_mx and module.rpartition(".")[2] == "experts" and leaf.endswith(SCALES) and \
                leaf[: -len(SCALES)] in FUSED_WEIGHTS:
            kinds[name] = Kind.DROP  # read with its blocks
            continue
        if is_mx and module.rpartition(".")[2] == "experts" and leaf.endswith(BLOCKS) and \
                leaf[: -len(BLOCKS)] in FUSED_WEIGHTS:
            sk = f"{module}.{leaf[: -len(BLOCKS)]}{SCALES}"
            if sk not in tensors or len(info.shape) != 4 or tuple(tensors[sk].shape) != tuple(info.shape[:3]):
                raise FormatError(f"{info.shard}: MXFP4 tensor {name!r} {list(info.shape)} needs {sk!r} of shape "
                                  f"{list(info.shape[:3])}")
            kinds[name] = Kind.COPY  # stands for its parts (expanded)
            mx_of[name] = tensors[sk]
            layout = FusedLayout(transposed=False, concatenated=fused.concatenated)  # [out, in] as stored
            expanded[name] = expand(module, info, leaf, layout, bias=False)
            continue
        if fused is not None and module.rpartition(".")[2] == "experts" and leaf in FUSED_WEIGHTS + FUSED_BIASES \
                and len(info.shape) == (3 if leaf in FUSED_WEIGHTS else 2):
            kinds[name] = Kind.COPY  # stands for its parts (expanded), never written as it is
            expanded[name] = expand(module, info, leaf, fused, bias=leaf in FUSED_BIASES)
            continue
        loaded = renamed.get(name, name).rpartition(".")  # GraniteMoE's input_linear: transformers' experts
        layout = layouts.get(loaded[0])  # stored as the model holds it: split by the model's own layout
        if layout is not None and layout.row_groups and loaded[2] in ("weight", "bias") \
                and len(info.shape) == (2 if loaded[2] == "weight" else 1):
            kinds[name] = Kind.COPY  # stands for its groups' linears (expanded), never written as it is
            expanded[name] = expand(module, info, loaded[2], layout, bias=loaded[2] == "bias")
            continue
        if layout is not None and layout.separate and loaded[2] in {p.value for p in Proj} and len(info.shape) == 3:
            kinds[name] = Kind.COPY  # one projection of every expert (moe.weighted_shared): its parts (expanded)
            expanded[name] = expand(loaded[0], info, loaded[2], layout, bias=False)
            continue
        if layout is not None and loaded[2] in FUSED_EXPERT_LEAVES | set(FUSED_BIASES) \
                and len(info.shape) == (2 if loaded[2].endswith("_bias") else 3):
            kinds[name] = Kind.COPY  # stands for its parts (expanded), never written as it is
            expanded[name] = expand(loaded[0], info, loaded[2], layout, bias=loaded[2].endswith("_bias"))
            continue
        if len(info.shape) == 3 and (_is_fused_experts(module, leaf) or _is_fused_experts(loaded[0], loaded[2])) \
                and not is_excluded_name(module, ignore):
            raise FormatError(f"{info.shard}: tensor {name!r} {list(info.shape)} holds fused experts (3-D); "
                              f"model-free quantization quantizes per-expert 2-D weights only: quantize this "
                              f"model in memory (without --model-free), which splits and quantizes every expert, "
                              f"or ignore the module with --ignore")
        if leaf != "weight" or len(info.shape) != 2:
            kinds[name] = Kind.COPY
            continue
        role = classify_weight(loaded[0], info.shape, vocab)  # as transformers loads it (DeepSeek-V4: head -> lm_head)
        if role == "embedding":
            embeddings.append(name)
            kinds[name] = Kind.COPY
            continue
        if role == "head":
            heads.append(name)
        if (role == "head" and not include_lm_head) or is_excluded_name(module, ignore) or \
                is_excluded_name(loaded[0], ignore):  # a router under a name transformers renames
            kinds[name] = Kind.COPY
            ignored.append(module)
            continue
        kinds[name] = Kind.QUANTIZE
        module_of[name] = module
        quantized.append(module)

    # tied embeddings: written once
    if not heads and not include_lm_head:
        ignored.append("lm_head")  # tied: the model's head has no tensor of its own, and stays float
    extra: list[tuple[str, TensorInfo]] = []  # (head module, embedding tensor) quantized from the embedding
    if tied_cfg is True:
        emb_in = [e for e in embeddings if e.rpartition(".")[0].split(".")[-1] in INPUT_EMBEDDING_COMPONENTS
                  and tensors[e].shape[0] == (vocab or tensors[e].shape[0])]
        if heads and not include_lm_head:
            for h in heads:
                kinds[h] = Kind.DROP  # transformers re-ties it to the embedding on load
        elif include_lm_head:
            if not heads and emb_in and not is_excluded_name("lm_head", ignore):
                extra.append(("lm_head", tensors[emb_in[0]]))
                quantized.append("lm_head")
    return Survey(ckpt, is_fp8, block, kinds, module_of, scale_of, mx_of, expanded, parts_of, extra, heads,
                  quantized, ignored, untie=tied_cfg is True and include_lm_head)


def plan_of(found: Survey, assign: Assignment | None) -> Plan:
    """The ``Plan`` of a survey under ``assign`` (``make_plan``): the checks that depend on the
    schemes (FP8 sources, groups dividing rows), shared global scales, the items in shard order."""
    ckpt, block, kinds, scale_of, mx_of = found.ckpt, found.block, found.kinds, found.scale_of, found.mx_of
    module_of, parts_of, expanded, extra = found.module_of, found.parts_of, found.expanded, found.extra
    scheme_of = _scheme_lookup(assign)
    for s in assign.distinct if assign is not None else ():
        if found.is_fp8 and s.weights.format is FormatName.E4M3 and s.weights.granularity is Granularity.BLOCK:
            raise FormatError(f"{ckpt.root}: the source is already FP8 (quant_method 'fp8', weight_block_size "
                              f"{list(block) if block else None}); quantizing it to {s.name} would round its FP8 "
                              f"weights a second time. Serve the source as it is, or quantize a float checkpoint")
    config_updates: dict[str, Any] = {}
    if found.untie and (any(kinds[h] is Kind.QUANTIZE for h in found.heads) or extra):
        config_updates["tie_word_embeddings"] = False

    # checks that need no tensor data, before anything is written
    def source(info: TensorInfo, part: ExpertPart | None = None) -> Source:
        s = scale_of.get(info.name)
        if info.name in mx_of:
            return Source(info, None, part, mx_of[info.name])
        if info.dtype not in FLOAT_SOURCES and s is None:
            raise FormatError(f"{info.shard}: tensor {info.name!r} has dtype {info.dtype}; model-free quantization "
                              f"reads bf16, fp16, fp32 or FP8 with block scales")
        return Source(info, s, part)

    weights = {m: source(ckpt.tensors[n]) for n, m in module_of.items()} | {m: source(e) for m, e in extra} | \
        {m: source(i, p) for m, (i, p) in parts_of.items()}
    schemes = {m: scheme_of(m) for m in weights} if assign is not None else {}
    for m, src in weights.items() if assign is not None else ():
        try:
            num_groups(src.shape[1], schemes[m].weights, src.key, src.shape)
        except QuantizationError as e:
            raise QuantizationError(f"{src.info.shard}: {e}") from None
    group_of: dict[str, tuple[Source, ...]] = {}
    for g in fused_groups(list(weights)) if assign is not None else ():
        if schemes[g[0]].weights.global_scale:  # fused siblings share one scheme (lowbit.recipes.resolve)
            srcs = tuple(weights[m] for m in g)
            for m in g:
                group_of[m] = srcs

    shards: dict[str, list[Item]] = {}
    for shard, infos in ckpt.shard_tensors.items():
        items: list[Item] = []
        for info in infos:
            k = kinds[info.name]
            if info.name in expanded:  # a fused experts tensor: one item per expert's part
                for kind, out, part in expanded[info.name]:
                    items.append(Item(kind, out, source(info, part),
                                      group_of.get(out, ()) if kind is Kind.QUANTIZE else (),
                                      schemes.get(out) if kind is Kind.QUANTIZE else None))
                continue
            if k is Kind.QUANTIZE:
                m = module_of[info.name]
                items.append(Item(k, m, source(info), group_of.get(m, ()), schemes.get(m)))
            elif k is Kind.COPY:  # FP8 tensors kept in float are dequantized to the model dtype
                items.append(Item(k, info.name, Source(info, scale_of.get(info.name))))
            else:
                items.append(Item(k, info.name, Source(info)))
            for m, e in extra:
                if e.name == info.name:
                    items.append(Item(Kind.QUANTIZE, m, source(e), group_of.get(m, ()), schemes.get(m)))
        shards[shard] = items
    quantized = found.quantized
    return Plan(scheme=assign.uniform if assign is not None else None, dtype=ckpt.dtype, fp8_block=block,
                shards=shards, quantized=quantized, ignored=sorted(set(found.ignored) - set(quantized)),
                config_updates=config_updates, schemes=schemes)


def _scheme_lookup(assign: Assignment | None):
    """module -> its scheme under make_plan's ``assign``."""
    def of(module: str) -> Scheme | None:
        s = assign.scheme_for(module) if assign is not None else None
        if s is None and assign is not None:  # the caller resolved the recipe on another set of modules
            raise QuantizationError(f"internal error: the recipe gave no scheme to {module!r}")
        return s
    return of
