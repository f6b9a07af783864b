"""``lowbit eval PATH``: perplexity and last-word accuracy (optionally against a baseline),
and lm-eval tasks through the adapter."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from lowbit.cli.app import app, console, err_console
from lowbit.cli.common import OptionError, check_model_path, model_arg, parse_list, quiet_progress
from lowbit.cli.figures import accuracy_cell, bracket, plus_minus


def _is_gguf(path: str | None) -> bool:
    """Whether a MODEL argument is a GGUF file (``lowbit.formats.gguf.is_gguf_file``: its magic bytes)."""
    from lowbit.models.builtin import is_gguf_path

    return model_arg(path) is not None and is_gguf_path(Path(path))


def _evaluate(path, settings, lastword, label, numerics=None, reference=None, keep_reference=False,
              gguf_weights=None):
    """Report fields of the model at ``path`` (lowbit.report.measures, against ``reference`` when
    given), its scores or (``keep_reference``) its FloatReference, the model and its tokenizer."""
    from lowbit.eval import lastword_examples, read_paragraphs
    from lowbit.models import load_model
    from lowbit.report.measures import measure

    model, tok = load_model(model_arg(path), numerics=numerics, gguf_weights=gguf_weights)
    examples = lastword_examples(read_paragraphs(settings.text_file), limit=lastword) if lastword > 0 else []
    fields, scores = measure(model, tok, settings, examples, label, reference=reference,
                             keep_reference=keep_reference)
    out = {"path": path, **fields}
    if getattr(model, "lowbit_format", None) == "gguf":  # read with its codes: which GGML type each linear holds
        from collections import Counter

        out["gguf_types"] = dict(Counter(model.lowbit_gguf_types.values()))
    if numerics is not None:
        out["numerics"] = numerics.value
    if examples:
        out["lastword"] = {k: out.pop(f"lastword_{f}") for k, f in (
            ("accuracy", "accuracy"), ("correct", "correct"), ("examples", "examples"), ("mean_logprob", "logprob"),
            ("interval", "interval"))}
        out["lastword"]["bos_prepended"] = out["bos_prepended"]  # one tokenizer start for both measures
    if keep_reference:  # a reference file carries the baseline's row as eval reports it
        scores.fields = {k: v for k, v in out.items() if k != "path"}
    return out, scores, model, tok


def _evaluate_vllm(path, text, limit, window, stride, lastword, vllm_python):
    """The same report through vLLM's prompt log-probabilities (lowbit.eval.engine, lowbit.engines)."""
    from transformers import AutoTokenizer

    from lowbit.engines import run_vllm
    from lowbit.eval.engine import engine_report
    from lowbit.models.builtin import resolve_model_path

    folder = resolve_model_path(model_arg(path))
    tok = AutoTokenizer.from_pretrained(folder)
    times = {}

    def score(prompts):
        r = run_vllm(folder, score=prompts, python=vllm_python)
        times.update(engine_load_s=r.load_s, engine_run_s=r.run_s)
        return r.logprobs, r.greedy

    ppl, lw = engine_report(score, tok, text_file=text, window=window, stride=stride, limit=limit, lastword=lastword)
    out = {"path": path, **ppl.to_dict(), "engine": "vllm", **times}
    if lw is not None:
        out["lastword"] = lw.to_dict()
    return out


@app.command("eval")
def eval_cmd(
    path: str = typer.Argument(..., help="Model folder (float or quantized), or 'builtin'."),
    baseline: Optional[str] = typer.Option(
        None, "--baseline",
        help="The float model to measure PATH against on the same tokens (KL divergence, same top token, paired "
             "perplexity change): a model folder, or a reference file written by --save-reference."),
    save_reference: Optional[str] = typer.Option(
        None, "--save-reference",
        help="Write PATH's float reference (hidden states at the scored tokens and its output head, one "
             "safetensors file) for later runs' --baseline."),
    text: Optional[str] = typer.Option(None, "--text", help="Evaluation text, one paragraph a line (default: built-in)."),
    limit: int = typer.Option(2048, "--limit", help="Perplexity tokens to score."),
    window: int = typer.Option(512, "--window", help="Perplexity window (tokens)."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride (default: the window)."),
    lastword: int = typer.Option(40, "--lastword", help="Last-word examples (0 skips)."),
    tasks: Optional[str] = typer.Option(None, "--tasks",
                                        help="lm-eval tasks, comma-separated (needs lm-eval; 'lowbit_lastword' is built in)."),
    include_path: Optional[str] = typer.Option(None, "--include-path", help="Folder of local lm-eval task YAMLs."),
    spread: Optional[int] = typer.Option(
        None, "--spread",
        help="Perturbed perplexity evaluations of a model with quantized activations, to report the float-rounding "
             "noise of its perplexity (default 2, as lowbit compare; 0 skips)."),
    numerics: str = typer.Option(
        "lowbit", "--numerics",
        help="Whose arithmetic: 'lowbit' (what the folder means), 'vllm-cpu' (what vLLM's CPU build computes "
             "serving it on an AVX2 host: bf16 model, its int8 rounding and scale order; w8a8-int8, "
             "w8a8-fp8-dynamic and float folders), 'vllm-cpu-avx512' (the same on an AVX-512 + VNNI host) or "
             "'llama-cpp-cpu' (a .gguf file as llama.cpp's CPU backend computes it: activations rounded to each "
             "weight type's vec_dot type, F16 KV cache)."),
    gguf_weights: Optional[str] = typer.Option(
        None, "--gguf-weights",
        help="A .gguf PATH or --baseline: 'codes' (default: lowbit.formats.gguf.read.DEFAULT_GGUF_WEIGHTS) keeps "
             "its GGML blocks (lowbit.load, decoded per forward), 'float' runs its float32 expansion by "
             "transformers (the same logits with --numerics lowbit)."),
    engine: str = typer.Option(
        "lowbit", "--engine",
        help="Who computes the log-probabilities: 'lowbit' or 'vllm' (vLLM serving the folder in bf16, run by "
             "its own Python: --vllm-python, else .venv-vllm/bin/python here or in a parent folder)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="Python of vLLM's venv (--engine vllm)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
) -> None:
    """Perplexity (tokens scored, bits per byte) and last-word accuracy of PATH."""
    if limit <= 0:
        raise OptionError(f"--limit must be a positive number of tokens to score, got {limit}")
    if spread is not None and spread < 0:
        raise OptionError(f"--spread must be 0 (skip) or a number of perturbed evaluations, got {spread}")
    check_model_path(path)
    baseline_file = baseline is not None and Path(baseline).is_file()
    if baseline is not None and not baseline_file:
        check_model_path(baseline)
    if save_reference is not None and baseline is not None:
        raise OptionError("--save-reference writes PATH's own reference: it goes without --baseline")
    if save_reference is not None:
        from lowbit.eval.reference import check_reference_path
        from lowbit.models.builtin import resolve_model_path

        check_reference_path(save_reference, resolve_model_path(model_arg(path)))
    # after the path checks: a missing path fails before torch is imported (lowbit.quant.serving imports it)
    from lowbit.quant.serving import ServingNumerics

    try:
        chosen = ServingNumerics(numerics)
    except ValueError:
        raise OptionError(f"--numerics must be one of {', '.join(n.value for n in ServingNumerics)}, "
                          f"got {numerics!r}") from None
    serving = None if chosen is ServingNumerics.LOWBIT else chosen
    from lowbit.formats.gguf.read import DEFAULT_GGUF_WEIGHTS, GgufWeights

    try:
        gguf_weights = DEFAULT_GGUF_WEIGHTS if gguf_weights is None else GgufWeights(gguf_weights)
    except ValueError:
        raise OptionError(f"--gguf-weights must be one of {', '.join(w.value for w in GgufWeights)}, "
                          f"got {gguf_weights!r}") from None
    if chosen is ServingNumerics.LLAMA_CPP_CPU and (gguf_weights is GgufWeights.FLOAT or not _is_gguf(path)):
        raise OptionError("--numerics llama-cpp-cpu computes a .gguf PATH read with --gguf-weights codes")
    if engine not in ("lowbit", "vllm"):
        raise OptionError(f"--engine must be 'lowbit' or 'vllm', got {engine!r}")
    if engine == "vllm":
        if serving is not None or tasks:
            raise OptionError("--engine vllm computes vLLM's own numbers: --numerics and --tasks go with --engine lowbit")
        from lowbit.engines import find_vllm_python

        find_vllm_python(vllm_python)  # a clear error before anything is tokenized
    elif vllm_python is not None:
        raise OptionError("--vllm-python goes with --engine vllm")
    if engine == "vllm" and (baseline_file or save_reference is not None):
        raise OptionError("--engine vllm has no float reference: --save-reference and a reference --baseline go "
                          "with --engine lowbit")
    from lowbit.eval import read_paragraphs

    quiet_progress(progress)
    read_paragraphs(text)  # a bad --text fails before any model is loaded
    from lowbit.eval.spread import DEFAULT_SPREAD_SEEDS
    from lowbit.report.measures import INTERVALS, EvalSettings

    settings = EvalSettings(text_file=text, window=window, stride=stride, limit=limit, progress=progress,
                            spread=DEFAULT_SPREAD_SEEDS if spread is None else spread)
    report: dict = {}
    if engine == "vllm":
        result = _evaluate_vllm(path, text, limit, window, stride, lastword, vllm_python)
        if baseline is not None:
            base = _evaluate_vllm(baseline, text, limit, window, stride, lastword, vllm_python)
            report["kld_note"] = "KL divergence needs the float model's hidden states: not with --engine vllm"
    elif baseline is not None:
        # the baseline first: its hidden states at the scored tokens are the reference of the KL divergence
        if baseline_file:
            from lowbit.eval.reference import FloatReference
            from lowbit.eval.text import read_text

            reference = FloatReference.load(baseline)
            reference.check_plan(read_text(text), window, stride, limit, baseline)
            base = {"path": baseline, **reference.fields}
        else:
            base_numerics = serving if _is_gguf(baseline) or chosen is not \
                ServingNumerics.LLAMA_CPP_CPU else None  # a float baseline runs as lowbit's
            base, reference, _, _ = _evaluate(baseline, settings, lastword, "baseline", base_numerics,
                                              keep_reference=True, gguf_weights=gguf_weights)
        result, _, model, tok = _evaluate(path, settings, lastword, "model", serving, reference=reference,
                                          gguf_weights=gguf_weights)
        del reference
    else:
        result, reference, model, tok = _evaluate(path, settings, lastword, "model", serving,
                                                  keep_reference=save_reference is not None, gguf_weights=gguf_weights)
        if save_reference is not None:
            report["reference"] = str(reference.save(save_reference))
    report["model"] = result
    if baseline is not None:
        report["baseline"] = base
        report["ppl_change_pct"] = 100.0 * (result["perplexity"] / base["perplexity"] - 1.0)
        sds = [r["ppl_spread"]["sd"] for r in (result, base) if "ppl_spread" in r]
        if sds:  # the change's float-rounding noise, in % of the baseline's perplexity
            report["ppl_change_sd_pct"] = 100.0 * sum(sd * sd for sd in sds) ** 0.5 / base["perplexity"]
        if "lastword" in result and base.get("lastword", {}).get("examples") == result["lastword"]["examples"]:
            report["lastword_delta"] = result["lastword"]["accuracy"] - base["lastword"]["accuracy"]
    if engine != "vllm":
        report["intervals"] = INTERVALS
    if tasks:
        from lowbit.eval.harness import LASTWORD_TASK, run_lm_eval, write_lastword_task

        names = parse_list(tasks, "--tasks")
        inc = include_path
        if inc is None and LASTWORD_TASK in names:
            inc = str(write_lastword_task(tempfile.mkdtemp(prefix="lowbit-tasks-"), text_file=text,
                                          limit=lastword or None))
        if progress:
            err_console.print(f"[dim]lm-eval: {', '.join(names)}[/dim]", highlight=False)
        report["lm_eval"] = run_lm_eval(model, tok, names, include_path=inc)
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    # piped output gets Rich's 80 columns by default: give the table and its lines the width they need
    out = console if console.is_terminal and console.width >= 120 else Console(width=140)
    out.print(eval_table(report))
    for line in against_baseline(report):
        out.print(line, highlight=False)
    for task, res in report.get("lm_eval", {}).items():
        console.print(f"lm-eval {task}: " + ", ".join(f"{k}={v:.4f}" for k, v in res.items()
                                                      if isinstance(v, float)), highlight=False)


def eval_table(report: dict) -> Table:
    """One row per model: perplexity (95% interval, float-rounding spread), bits per byte, last word."""
    result = report["model"]
    t = Table(title=f"lowbit eval ({result['tokens_scored']} tokens, window {result['window']})")
    for c in ("model", "perplexity [95% CI]", "fp spread", "bits/byte", "last word [95% CI]"):
        t.add_column(c, justify="left" if c == "model" else "right", no_wrap=True)
    for r in [result] + ([report["baseline"]] if "baseline" in report else []):
        lw = r.get("lastword")
        sp = r.get("ppl_spread")
        ppl = bracket(r["perplexity_interval"]) if "perplexity_interval" in r else f"{r['perplexity']:.3f}"
        cell = "-" if lw is None else accuracy_cell({"lastword_interval": lw.get("interval"),
                                                      "lastword_examples": lw["examples"]}) \
            if "interval" in lw else f"{100 * lw['accuracy']:.1f}% of {lw['examples']}"
        t.add_row(str(r["path"]), ppl, f"±{sp['sd']:.3f}" if sp else "-", f"{r['bits_per_byte']:.4f}", cell)
    return t


def against_baseline(report: dict) -> list[str]:
    """The model against its baseline on the same tokens, one figure a line."""
    if "ppl_change_pct" not in report:
        return []
    r = report["model"]
    sd = report.get("ppl_change_sd_pct")
    spread = "" if sd is None else f"; float-rounding spread ±{sd:.2f}"
    if "ppl_change_interval" not in r:
        return [f"perplexity change vs baseline: {report['ppl_change_pct']:+.2f}%{spread}"]
    k = r["kld_percentiles"]
    return [f"perplexity change vs baseline: {bracket(r['ppl_change_interval'], unit='%', signed=True)} "
            f"(paired, 95%){spread}",
            f"KL divergence (baseline || model): {plus_minus(r['kld'])} nats/token; median {k['p50']:.3g}, "
            f"p99 {k['p99']:.3g}, max {k['max']:.3g}",
            f"same top token: {plus_minus(r['same_top'], 100, '%')}; RMS Δp {100 * r['rms_delta_p']:.3f}%"]
