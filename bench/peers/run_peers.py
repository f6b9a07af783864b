"""Same scheme, same model, same text: lowbit against auto-round, llm-compressor and torchao,
each in its own virtual environment with torch==2.13.0.

    .venv/bin/python bench/peers/run_peers.py --scheme w4a16 [--install] [--limit 2048]
    .venv/bin/python bench/peers/run_peers.py --scheme nvfp4 --peers auto-round-tuned,llmcompressor-gptq \
        --iters 50 [--layers 4] --threads 1 --no-lowbit --reuse --work /tmp/lowbit-peers/work-tuned

Peers: auto-round (RTN: iters=0, disable_opt_rtn), auto-round-tuned (its SignRound tuning,
--iters steps per block), llmcompressor (QuantizationModifier: RTN), llmcompressor-gptq
(GPTQModifier, SmoothQuantModifier first for W8A8 INT8), torchao (RTN). The tuned tools calibrate
on the same 16 x 256 token windows (calib-ids.safetensors in --work, cut with lowbit's rule).

Records per tool: quantization time, peak RSS while quantizing, perplexity and its change
against float (float measured once, in the lowbit run or, with --no-lowbit, in a float-only
row, on the same token windows). Appends a
dated section with the machine to bench/peers/RESULTS.md. A peer that fails to install or to run
is recorded with its error; nothing else stops.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
# the versions measured in bench/peers/RESULTS.md (auto-round 0.16.1, llmcompressor 0.14.0.1): pinned so
# that later runs compare the same code
PEERS = {"auto-round": "auto-round==0.16.1", "llmcompressor": "llmcompressor==0.14.0.1", "torchao": "torchao"}
# worker tool -> the venv (PEERS key) it runs in
PEER_VENV = {"auto-round": "auto-round", "auto-round-tuned": "auto-round", "llmcompressor": "llmcompressor",
             "llmcompressor-gptq": "llmcompressor", "llmcompressor-gptq-down": "llmcompressor", "torchao": "torchao"}
ITERS_TOOLS = ("auto-round-tuned", "lowbit-best-iters")  # as worker.ITERS_TOOLS
CALIB_SAMPLES, CALIB_SEQ = 16, 256
# the tools that calibrate on those windows (calib-ids.safetensors; lowbit-best cuts the same ones)
TUNED_TOOLS = ("auto-round-tuned", "llmcompressor-gptq", "llmcompressor-gptq-down", "lowbit-best", "lowbit-best-iters")


def sh(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {timeout} s\n")
            return 124


def install_peer(root: Path, peer: str) -> tuple[Path, str | None]:
    """A venv for ``peer`` under ``root`` (torch==2.13.0 first, then the peer); (python, error)."""
    v = root / peer
    py = v / "bin" / "python"
    log = root / f"{peer}.install.log"
    if (v / ".installed").exists():
        return py, None
    steps = [[sys.executable, "-m", "venv", str(v)],
             [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
             [str(py), "-m", "pip", "install", "-q", PEERS[peer], "transformers>=5,<6", "safetensors", "accelerate"]]
    for cmd in steps:
        if sh(cmd, log) != 0:
            return py, f"install failed: {' '.join(cmd[-4:])} (see {log})"
    (v / ".installed").touch()
    return py, None


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


FIXED_LABELS = {"auto-round": "auto-round RTN", "llmcompressor": "llmcompressor RTN", "torchao": "torchao RTN",
                "float": "float (not quantized)"}


def label(r: dict) -> str:
    """The tool as RESULTS.md names it: the recipe, and the tuning length where it has one."""
    tool, it = r.get("tool", "?"), r.get("iters")
    if tool == "auto-round-tuned":
        return f"auto-round tuned iters {it}"
    if tool == "lowbit-best-iters":
        return f"lowbit best, reconstruct iters {it}"
    if tool == "llmcompressor-gptq":
        return "llmcompressor SmoothQuant 0.8 + GPTQ" if r.get("scheme") in ("w8a8-int8-dynamic", "w8a8-int8") \
            else "llmcompressor GPTQ"
    if tool == "llmcompressor-gptq-down":
        return "llmcompressor SmoothQuant 0.8 (+ down_proj <- up_proj) + GPTQ"
    return FIXED_LABELS.get(tool, tool)


def result_name(tool: str, scheme: str, iters: int, layers: int | None) -> str:
    """The result JSON's file name in --work: one per tool, scheme, tuning length and layer count."""
    if tool == "float":
        return "float.json"
    return (f"{tool}{f'-iters{iters}' if tool in ITERS_TOOLS else ''}"
            f"{f'-layers{layers}' if layers is not None else ''}-{scheme}.json")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} CPUs, load average {load:.1f} at start, {platform.platform()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--model", default=None, help="model folder (default: lowbit's built-in SmolLM2-135M)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated, of: {', '.join(PEER_VENV)} (default: the RTN ones)")
    ap.add_argument("--iters", type=int, default=200,
                    help="tuning steps per block of auto-round-tuned and lowbit-best-iters (default 200)")
    ap.add_argument("--layers", type=int, default=None,
                    help="quantize only decoder layers 0..N-1 in every tool (default: all)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker (and OMP/MKL_NUM_THREADS; default: torch's own)")
    ap.add_argument("--no-lowbit", action="store_true",
                    help="skip lowbit's default row; measure the float perplexity alone (tool 'float')")
    ap.add_argument("--lowbit-best", action="store_true", help="also run lowbit's 'best' calibration preset")
    ap.add_argument("--lowbit-best-iters", action="store_true",
                    help="also run the 'best' preset with --iters reconstruction steps")
    ap.add_argument("--venv-root", default="/tmp/lowbit-peers")
    ap.add_argument("--install", action="store_true", help="create missing peer venvs")
    ap.add_argument("--limit", type=int, default=2048, help="evaluation tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--work", default="/tmp/lowbit-peers/work")
    ap.add_argument("--reuse", action="store_true", help="reuse a tool's result already in --work (same ids)")
    ap.add_argument("--lowbit-gptq", action="store_true", help="also run lowbit with GPTQ weight rounding")
    ap.add_argument("--lowbit-gptq-fast", action="store_true",
                    help="also run lowbit's 'gptq-fast' calibration preset (GPTQ, 4 x 128 tokens, float layer inputs)")
    ap.add_argument("--lowbit-float", action="store_true",
                    help="also run lowbit's defaults calibrated on float layer inputs (layer_inputs='float')")
    ap.add_argument("--lowbit-rtn", action="store_true",
                    help="also run lowbit with round-to-nearest weights (for schemes whose default is GPTQ), "
                         "calibrated layer by layer on quantized and on float inputs")
    ap.add_argument("--no-results", action="store_true", help="do not append to bench/peers/RESULTS.md")
    a = ap.parse_args()

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from lowbit.eval.text import default_calibration_text_path, read_text
    from lowbit.models import resolve_model_path

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    root = Path(a.venv_root)
    root.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(a.model)
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    n_windows = -(-a.limit // (a.window - 1))
    ids = ids[: n_windows * a.window].contiguous()
    ids_file = work / "ids.safetensors"
    if not (a.reuse and ids_file.exists()):
        save_file({"ids": ids}, str(ids_file))
    calib = str(default_calibration_text_path())
    # the tuned tools' calibration: the windows lowbit cuts from the same file with num_samples=16,
    # seq_len=256 (lowbit-best cuts them itself from the path)
    calib_file = work / "calib-ids.safetensors"
    if not (a.reuse and calib_file.exists()):
        from lowbit.calibration import calibration_tokens

        save_file({"ids": calibration_tokens(calib, tok, num_samples=CALIB_SAMPLES, seq_len=CALIB_SEQ).contiguous()},
                  str(calib_file))
    n_layers = json.loads((Path(model) / "config.json").read_text()).get("num_hidden_layers")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if a.threads:
        env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    start = dt.datetime.now(dt.timezone.utc)
    mach = machine()

    rows, reused = [], []
    tools = [("float" if a.no_lowbit else "lowbit", Path(sys.executable), None)]
    if a.lowbit_best:
        tools.append(("lowbit-best", Path(sys.executable), None))
    if a.lowbit_best_iters:
        tools.append(("lowbit-best-iters", Path(sys.executable), None))
    if a.lowbit_gptq:
        tools.append(("lowbit-gptq", Path(sys.executable), None))
    if a.lowbit_gptq_fast:
        tools.append(("lowbit-gptq-fast", Path(sys.executable), None))
    if a.lowbit_float:
        tools.append(("lowbit-float", Path(sys.executable), None))
    if a.lowbit_rtn:
        tools.append(("lowbit-rtn", Path(sys.executable), None))
        tools.append(("lowbit-rtn-float", Path(sys.executable), None))
    for p in [p for p in a.peers.split(",") if p]:
        if p not in PEER_VENV:
            raise SystemExit(f"unknown peer {p!r}; known: {', '.join(PEER_VENV)}")
        venv = PEER_VENV[p]
        py = root / venv / "bin" / "python"
        err = None
        if a.install:
            py, err = install_peer(root, venv)
        elif not py.exists():
            err = f"no venv at {root / venv} (run with --install)"
        tools.append((p, py, err))
    for tool, py, err in tools:
        out = work / result_name(tool, a.scheme, a.iters, a.layers)
        failed = {"tool": tool, "scheme": a.scheme, "status": "error", "layers": a.layers,
                  "iters": a.iters if tool in ITERS_TOOLS else None}
        if a.reuse and out.exists():
            r = json.loads(out.read_text())
            if tool != "float":  # the reused float reference does not date the section
                reused.append(out.stat().st_mtime)
        elif err is None:
            print(f"[{tool}] quantizing {a.scheme} ...", flush=True)
            cmd = [str(py), str(HERE / "worker.py"), "--tool", tool, "--model", str(model), "--scheme", a.scheme,
                   "--ids", str(work / "ids.safetensors"), "--calib", calib, "--calib-ids", str(calib_file),
                   "--window", str(a.window), "--iters", str(a.iters), "--threads", str(a.threads),
                   "--out", str(out)] + (["--float"] if tool == "lowbit" else []) \
                + (["--layers", str(a.layers)] if a.layers is not None and tool != "float" else [])
            env_log = out.with_suffix(".log")
            if out.exists():
                out.unlink()
            rc = sh(cmd, env_log, a.timeout, env)
            r = json.loads(out.read_text()) if out.exists() else dict(failed, error=f"worker exit {rc} (see {env_log})")
        else:
            r = dict(failed, error=err)
        rows.append(r)
        print(f"[{tool}] {r.get('status')}: {r.get('error') or ''}", flush=True)

    if reused:  # date the section by when those results were measured
        start = min(start, dt.datetime.fromtimestamp(min(reused), dt.timezone.utc))
    base = next((r.get("float_ppl") for r in rows if r.get("float_ppl")), None)
    tuned = [label(r) for r in rows if r["tool"] in TUNED_TOOLS]
    same = f" {', '.join(tuned)}: calibrated on the same {CALIB_SAMPLES} x {CALIB_SEQ} token windows." if tuned else ""
    part = "" if a.layers is None else f", decoder layers 0-{a.layers - 1} of {n_layers} quantized (the rest float)"
    lines = [f"\n## {a.scheme} on {Path(model).name}{part}: {start:%Y-%m-%d %H:%M} UTC\n",
             f"Machine: {mach}. Torch threads per tool: {a.threads or 'default'}. "
             f"Text: lowbit's built-in evaluation text (Persuasion), "
             f"{rows[0].get('tokens', '?')} tokens in {a.window}-token windows, identical ids for every tool. "
             f"Float perplexity: {base if base is None else f'{base:.3f}'}.{same}\n",
             "| tool | version | quantize wall s | quantize CPU s | peak RSS while quantizing (MB) "
             "| RSS growth (MB) | perplexity | change vs float | KLD ±95% (p99) | same top | "
             "load avg (quantize start, end) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") == "ok":
            ch = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else "-"
            load = (f"{r['loadavg_start']:.1f}, {r['loadavg_end_quant']:.1f}" if "loadavg_start" in r else "-")
            kld = (f"{r['kld']:.4f} ±{r['kld_half95']:.4f} ({r['kld_p99']:.3f}) | {100 * r['same_top']:.1f}%"
                   if "kld" in r else "- | -")
            lines.append(f"| {label(r)} | {r.get('version', '?')} | {r['quant_s']:.1f} | {_num(r.get('quant_cpu_s'))} | "
                         f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['rss_before_mb']:.0f} | {r['ppl']:.3f} | {ch} "
                         f"| {kld} | {load} |")
        else:
            lines.append(f"| {label(r)} | {r.get('version', '-')} | failed: {r.get('error', '?')[:160]} | | | | | | | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    summary = f"summary-iters{a.iters}{f'-layers{a.layers}' if a.layers is not None else ''}-{a.scheme}.json"
    (work / summary).write_text(json.dumps(rows, indent=2))
    if not a.no_results:
        header = "" if RESULTS.exists() else "# Benchmarks\n\nAppended by the scripts under bench/.\n"
        with open(RESULTS, "a") as f:
            f.write(header + text)


if __name__ == "__main__":
    main()
