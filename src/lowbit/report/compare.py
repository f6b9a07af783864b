"""``lowbit compare``: quantize one model under several schemes and measure each against float.

Per scheme, against the float model on the same tokens (lowbit.report.measures): perplexity and
its paired change, KL divergence (the float model's hidden states kept once, the float
distribution recomputed exactly for every row: lowbit.eval.reference), same top token, last-word
accuracy, each with its 95% interval; which rows are within noise of each other (``pairs``);
size (packed estimate, or on disk when a checkpoint format is given), quantization time, and the
SQNR of every quantized linear's output. Schemes with static activation scales are calibrated
on the calibration text (never the evaluation text) through ``lowbit.quantize``.

``CompareOptions.kv_cache="fp8"`` (CLI ``--kv-cache fp8``) adds a calibrated FP8 KV cache
(``lowbit.kvcache``) to every scheme row: each is then calibrated (weight-only and dynamic
schemes too, for the KV scales), its row carries ``"kv_cache": "fp8"`` and is labelled
``<scheme>+kv-fp8`` (``row_label``); float stays float. Run compare twice, with and without,
to see the KV cache's own cost.
"""

from __future__ import annotations

import copy
import datetime as _dt
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

import lowbit
from lowbit.calibration import CalibrationConfig, FloatStates
from lowbit.errors import LowbitError
from lowbit.kvcache import DEFAULT_KV_CACHE, check_kv_cache
from lowbit.eval.lastword import lastword_examples
from lowbit.eval.perplexity import tokenize_with_bytes
from lowbit.eval.spread import DEFAULT_SPREAD_SEEDS
from lowbit.eval.text import read_paragraphs
from lowbit.linearize import linearize
from lowbit.report.measures import INTERVALS, EvalSettings, measure, noise_pairs, within_noise_of
from lowbit.report.writer import row_label
from lowbit.report.layers import estimated_size_bytes, layer_sqnr, quantized_linears
from lowbit.schemes import get_scheme
from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.textstart import bos_to_prepend, prepend

DEFAULT_SCHEMES = ("nvfp4", "nvfp4-e5m3", "w8a8-int8", "w8a8-fp8")


@dataclass
class CompareOptions:
    """What ``run_compare`` measures. Defaults finish in minutes for a 135M model on 2 cores."""

    schemes: list[str] = field(default_factory=lambda: list(DEFAULT_SCHEMES))
    limit: int = 1024               # perplexity tokens scored
    window: int = 512
    stride: int | None = None
    lastword: int = 16              # last-word examples
    lastword_context: int = 96      # context tokens per last-word example (cut from the left)
    text_file: str | None = None    # evaluation text (default: built-in)
    calib: object = None            # lowbit.quantize's calibration= (a path, "builtin", CalibrationSources...;
    #                                  default None: lowbit's built-in calibration text)
    calib_preset: str | None = None     # a name of CALIBRATION_PRESETS: its fields under calib_options and the
    #                                      calib_samples / calib_seq_len given (as lowbit.quantize's preset=)
    calib_samples: int | None = None    # None: the preset's, else CalibrationConfig's default (as lowbit.quantize)
    calib_seq_len: int | None = None    # None: the preset's, else CalibrationConfig's default
    # SmoothQuant, as lowbit.quantize takes it (scheme_alphas, for every row and every group of a recipe):
    # DEFAULT (the per-format alpha of lowbit.algorithms.smoothquant.defaults: 0.8 static INT8 inputs,
    # 0.5 static FP8 ones, none for the others), an alpha in [0, 1] or "auto" (every scheme), "none" / None (off)
    smoothquant: float | str | None = DEFAULT
    calib_options: dict = field(default_factory=dict)  # more CalibrationConfig fields (sink_positions,
    #                                                     weight_rounding...)
    backend: str = "auto"           # "auto" (lowbit.use_backend's default) or a backend name
    spread: int = DEFAULT_SPREAD_SEEDS  # perturbed perplexity evaluations per scheme with quantized
    #                                      activations (lowbit.eval.spread); 0 skips
    sqnr_tokens: int = 128
    save_format: str | None = None  # also save each checkpoint (lowbit.save) and measure it on disk
    progress: bool = True
    kv_cache: str | None = DEFAULT_KV_CACHE  # "fp8": a calibrated FP8 KV cache on every scheme row
    recipes: list[str] = field(default_factory=list)     # recipe files, one row each (lowbit.recipes)
    target_bits: list[float] = field(default_factory=list)  # one automatic-recipe row per budget ...
    candidates: list[str] = field(default_factory=list)     # ... choosing among these schemes

    def __post_init__(self) -> None:
        # one calibration budget default: lowbit.quantize's (the preset's, else CalibrationConfig's)
        budget = CalibrationConfig.preset(self.calib_preset) if self.calib_preset is not None else CalibrationConfig
        if self.calib_samples is None:
            self.calib_samples = budget.num_samples
        if self.calib_seq_len is None:
            self.calib_seq_len = budget.seq_len
        check_kv_cache(self.kv_cache)

    def to_dict(self) -> dict:
        d = asdict(replace(self, calib=None))  # the calibration (a dataset object...) as JSON-able text
        d["calib"] = _calib_json(self.calib)
        return d


def _calib_json(calib):
    """``calib`` for report.json: None, a string, or each source's data (as text) and weight."""
    from lowbit.calibration.sources import CalibrationSource

    if calib is None or isinstance(calib, str):
        return calib
    items = calib if isinstance(calib, (list, tuple)) else [calib]
    if items and all(isinstance(c, CalibrationSource) for c in items):
        return [{"data": c.data if isinstance(c.data, str) else str(c.data) if isinstance(c.data, os.PathLike)
                 else type(c.data).__name__, "weight": c.weight, "column": c.column, "split": c.split} for c in items]
    return str(calib) if isinstance(calib, os.PathLike) else type(calib).__name__


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


@dataclass(frozen=True)
class RowSpec:
    """One row of the comparison: a scheme (by name), a recipe, or a budget for ``auto_recipe``."""

    label: str
    scheme: str | None = None
    recipe: object = None
    target_bits: float | None = None


def row_specs(opts: CompareOptions) -> list[RowSpec]:
    """The rows ``opts`` asks for, checked before any work (unknown schemes, bad recipe files)."""
    from lowbit.recipes import Recipe
    from lowbit.recipes.auto import budget_label, parse_candidates

    specs = [RowSpec(get_scheme(s).name, scheme=get_scheme(s).name) for s in opts.schemes]
    specs += [RowSpec(Path(p).stem, recipe=Recipe.of(Path(p))) for p in opts.recipes]
    if opts.target_bits:
        if not opts.candidates:
            raise LowbitError("automatic-recipe rows (target_bits) need candidates (the schemes to choose from)")
        parse_candidates(opts.candidates)
        specs += [RowSpec(budget_label(b), target_bits=float(b)) for b in opts.target_bits]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise LowbitError(f"two rows of the comparison have one name: {labels}")
    return specs


def quantize_with_options(model, scheme_name: "str | RowSpec", tokenizer, opts: CompareOptions,
                          float_states=None):
    """Quantize ``model`` for one row: its ``lowbit.method.Method`` resolved as ``lowbit.quantize``
    resolves its arguments (``resolve_method``), run in memory (``run_in_memory``: calibrated when a
    scheme, SmoothQuant or the KV cache asks for it); returns (model, calibrated: bool, smoothquant
    alpha or None). A RowSpec with a recipe quantizes with it; with ``target_bits`` the recipe is
    chosen first (``lowbit.auto_recipe`` among ``opts.candidates``, on the calibration text) and
    left on the model as ``lowbit_auto``. ``float_states``: shared by the rows (``lowbit.quantize``'s;
    the same codes, fewer float passes)."""
    from lowbit.method import CalibrationChoice, resolve_method
    from lowbit.model_quant import InMemoryPlan, run_in_memory

    spec = scheme_name if isinstance(scheme_name, RowSpec) else RowSpec(scheme_name, scheme=scheme_name)
    options = {**opts.calib_options, "num_samples": opts.calib_samples, "seq_len": opts.calib_seq_len}
    calib = opts.calib if opts.calib is not None else "builtin"
    auto = None
    if spec.target_bits is not None:
        # on the windows the row calibrates on below (the same options)
        auto = lowbit.auto_recipe(model, opts.candidates, spec.target_bits, calib, tokenizer=tokenizer,
                                  preset=opts.calib_preset, **options)
    given = get_scheme(spec.scheme) if spec.scheme is not None else spec.recipe if spec.recipe is not None \
        else auto.recipe
    method = resolve_method(given, CalibrationChoice(calib, tokenizer, opts.smoothquant, preset=opts.calib_preset,
                                                     options=options))
    calibrated = method.calibrates(method.schemes) or opts.kv_cache is not None
    q = run_in_memory(model, InMemoryPlan(method, kv_cache=opts.kv_cache), progress=opts.progress,
                      float_states=float_states)
    q.lowbit_auto = auto
    if not calibrated:
        return q, False, None
    if spec.scheme is not None:
        return q, True, method.alphas[given]
    report = getattr(q, "lowbit_calibration", None)  # None: only the KV cache was calibrated
    sq = report.smoothquant if report is not None else None  # the alphas the recipe's schemes got, by name
    return q, True, None if not isinstance(sq, dict) or all(a is None for a in sq.values()) else sq


def set_backends(qmodel, name: str) -> None:
    """``name`` ("auto" or a backend) for every quantized layer."""
    from lowbit.backends import use_backend

    use_backend(qmodel, name)


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def eval_settings(opts: CompareOptions) -> EvalSettings:
    """What every row (float's included) is evaluated on."""
    return EvalSettings(text_file=opts.text_file, window=opts.window, stride=opts.stride, limit=opts.limit,
                        lastword_context=opts.lastword_context, spread=opts.spread, progress=opts.progress)


def _recipe_fields(row: dict, qmodel, spec: RowSpec) -> None:
    """A row's average weight bits and linears per scheme; for recipe rows the recipe used, and
    for automatic rows what the choice reached."""
    from lowbit.recipes.weight_bits import average_bits

    lins = quantized_linears(qmodel)
    row["average_bits"] = average_bits({n: (m.out_features, m.in_features) for n, m in lins.items()},
                                       {n: m.scheme for n, m in lins.items()}) if lins else None
    counts: dict[str, int] = {}
    for m in lins.values():
        counts[m.scheme.name] = counts.get(m.scheme.name, 0) + 1
    row["linears_per_scheme"] = counts
    auto = getattr(qmodel, "lowbit_auto", None)
    if spec.recipe is not None or auto is not None:
        row["recipe"] = (spec.recipe if auto is None else auto.recipe).to_dict()
    if auto is not None:
        row["auto_recipe"] = {"target_bits": auto.target_bits, "predicted_loss": auto.predicted_loss,
                              "seconds": auto.seconds, "windows": auto.windows, "calibration": auto.calibration}


def run_compare(model=None, tokenizer=None, *, model_path: str | os.PathLike | None = None,
                opts: CompareOptions | None = None, output_dir: str | os.PathLike | None = None,
                log: Callable[[str], None] = lambda s: None) -> dict:
    """Compare schemes on ``model`` (or load ``model_path``; None: the built-in model).

    Writes ``report.json`` and ``report.png`` into ``output_dir`` when given; returns the report.
    """
    from lowbit.models import load_model, resolve_model_path

    opts = opts or CompareOptions()
    specs = row_specs(opts)  # unknown names and bad recipe files fail before any work
    if model is None:
        folder = resolve_model_path(model_path)
        log(f"loading {folder}")
        model, tokenizer = load_model(folder)
        model_desc = str(folder)
    else:
        model_desc = type(model).__name__
    if tokenizer is None:
        raise LowbitError("run_compare needs the model's tokenizer")
    model.eval()
    linearize(model)  # MoE: the float model computes the same, and its experts match the quantized ones by name

    paragraphs = read_paragraphs(opts.text_file)
    examples = lastword_examples(paragraphs, limit=opts.lastword) if opts.lastword > 0 else []
    ids, _ = tokenize_with_bytes(tokenizer, "\n".join(paragraphs))
    sqnr_ids = prepend(ids[: max(opts.sqnr_tokens, 2)], bos_to_prepend(tokenizer))[None]  # as the model sees text

    report: dict = {
        "lowbit_version": lowbit.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": {"path": model_desc, "class": type(model).__name__,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "text": opts.text_file or "builtin (Persuasion, lowbit/data/evaluation.txt)",
        "options": opts.to_dict(),
    }
    log("evaluating float")
    settings = eval_settings(opts)
    # the float model's hidden states at the scored tokens: every row's KL divergence is taken against them
    base, reference = measure(model, tokenizer, settings, examples, "float", keep_reference=True)
    base["size_bytes"] = estimated_size_bytes(model)
    report["float"] = base

    rows, row_scores = [], {}
    float_states = FloatStates()  # the float model's hidden states on the calibration windows, shared by the rows
    save_root = None
    if opts.save_format is not None:
        save_root = Path(output_dir) / "checkpoints" if output_dir is not None else Path(tempfile.mkdtemp(prefix="lowbit-cmp-"))
    for spec in specs:
        name = spec.label
        log(f"quantizing {name}")
        row: dict = {"scheme": name, "kv_cache": opts.kv_cache}
        qmodel = copy.deepcopy(model)
        try:
            t0 = time.perf_counter()
            qmodel, calibrated, sq = quantize_with_options(qmodel, spec, tokenizer, opts, float_states)
            _recipe_fields(row, qmodel, spec)
            row["quant_seconds"] = time.perf_counter() - t0
            row["calibrated"] = calibrated
            row["smoothquant"] = sq
            cal = getattr(qmodel, "lowbit_calibration", None)
            if cal is not None:  # seconds and layer passes per calibration phase (lowbit.calibration.cost)
                row["calibration_cost"] = cal.cost.as_dict()
                row["calibration_data"] = cal.data  # source, samples, tokens, packing, chat template
                report.setdefault("calibration_data", cal.data)
            set_backends(qmodel, opts.backend)
            row["backends"] = sorted({getattr(m.backend, "name", "?") for m in quantized_linears(qmodel).values()})
            fields, row_scores[row_label(row)] = measure(qmodel, tokenizer, settings, examples, name,
                                                         reference=reference)
            row.update(fields)
            row["size_bytes"] = estimated_size_bytes(qmodel)
            row["size_source"] = "estimate"
            if save_root is not None:
                dest = save_root / name
                lowbit.save(qmodel, dest, format=opts.save_format, tokenizer=tokenizer, overwrite=True)
                row["size_bytes"] = _dir_bytes(dest)
                row["size_source"] = f"disk ({opts.save_format})"
                row["checkpoint"] = str(dest)
            rotated = getattr(qmodel, "lowbit_rotation", None)
            row["rotation"] = rotated.describe() if rotated is not None else None
            # SmoothQuant rescales layer inputs and weights (exactly, as a whole), and a rotation
            # rotates them, so such a layer cannot be fed the float model's input: per-layer SQNR
            # only without either
            layers = layer_sqnr(model, qmodel, sqnr_ids) if sq is None and rotated is None else {}
            if sq is not None or rotated is not None:
                why = "SmoothQuant" if sq is not None else "the rotation"
                row["sqnr_note"] = f"per-layer SQNR not measured: {why} changed each layer's input"
            row["layers"] = {k: _finite(v) for k, v in layers.items()}
            finite = {k: v for k, v in layers.items() if math.isfinite(v)}
            worst = sorted(finite, key=finite.get)[:5]
            row["worst_layers"] = [[k, finite[k]] for k in worst]
            row["mean_sqnr_db"] = sum(finite.values()) / len(finite) if finite else None
            if "ppl_spread" in row:  # the change's own noise: the spread, in % of float's perplexity
                row["ppl_change_sd_pct"] = 100.0 * row["ppl_spread"]["sd"] / base["perplexity"]
            if "lastword_accuracy" in row:
                row["lastword_delta"] = row["lastword_accuracy"] - base["lastword_accuracy"]
            row["size_ratio"] = row["size_bytes"] / base["size_bytes"]
            row["status"] = "ok"
        except (LowbitError, NotImplementedError) as e:
            row["status"] = "error"
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"{name}: {row['error']}")
        finally:
            del qmodel
        rows.append(row)
    del float_states, reference
    pairs = noise_pairs(row_scores)
    for row in rows:
        if row.get("status") == "ok":
            row["within_noise_of"] = within_noise_of(pairs, row_label(row))
    report["schemes"] = rows
    report["pairs"] = pairs
    report["intervals"] = INTERVALS

    if output_dir is not None:
        from lowbit.report.writer import write_report

        paths = write_report(report, output_dir)
        report["files"] = {k: str(v) for k, v in paths.items()}
    return report
