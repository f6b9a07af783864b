"""Same scheme, same model, same text: lowbit against auto-round (RTN, iters=0), llm-compressor
(oneshot) and torchao, each in its own virtual environment with torch==2.13.0.

    .venv/bin/python bench/peers/run_peers.py --scheme w4a16 [--install] [--limit 2048]

Records per tool: quantization time, peak RSS while quantizing, perplexity and its change
against float (float measured once, in the lowbit run, on the same token windows). Appends a
dated section with the machine to bench/RESULTS.md. A peer that fails to install or to run
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
RESULTS = HERE.parent / "RESULTS.md"
PEERS = {"auto-round": "auto-round", "llmcompressor": "llmcompressor", "torchao": "torchao"}


def sh(cmd: list[str], log: Path, timeout: float | None = None) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
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
    ap.add_argument("--peers", default=",".join(PEERS))
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
    ap.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
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
    start = dt.datetime.now(dt.timezone.utc)
    mach = machine()

    rows, reused = [], []
    tools = [("lowbit", Path(sys.executable), None)]
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
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
        py = root / p / "bin" / "python"
        err = None
        if a.install:
            py, err = install_peer(root, p)
        elif not py.exists():
            err = f"no venv at {root / p} (run with --install)"
        tools.append((p, py, err))
    for tool, py, err in tools:
        out = work / f"{tool}-{a.scheme}.json"
        if a.reuse and out.exists():
            r = json.loads(out.read_text())
            reused.append(out.stat().st_mtime)
        elif err is None:
            print(f"[{tool}] quantizing {a.scheme} ...", flush=True)
            cmd = [str(py), str(HERE / "worker.py"), "--tool", tool, "--model", str(model), "--scheme", a.scheme,
                   "--ids", str(work / "ids.safetensors"), "--calib", calib, "--window", str(a.window),
                   "--out", str(out)] + (["--float"] if tool == "lowbit" else [])
            env_log = work / f"{tool}-{a.scheme}.log"
            if out.exists():
                out.unlink()
            rc = sh(cmd, env_log, a.timeout)
            r = json.loads(out.read_text()) if out.exists() else {"tool": tool, "status": "error",
                                                                    "error": f"worker exit {rc} (see {env_log})"}
        else:
            r = {"tool": tool, "status": "error", "error": err}
        rows.append(r)
        print(f"[{tool}] {r.get('status')}: {r.get('error') or ''}", flush=True)

    if reused:  # date the section by when those results were measured
        start = dt.datetime.fromtimestamp(min(reused), dt.timezone.utc)
    base = next((r.get("float_ppl") for r in rows if r.get("float_ppl")), None)
    lines = [f"\n## {a.scheme} on {Path(model).name}: {start:%Y-%m-%d %H:%M} UTC\n",
             f"Machine: {mach}. Text: lowbit's built-in evaluation text (Persuasion), "
             f"{rows[0].get('tokens', '?')} tokens in {a.window}-token windows, identical ids for every tool. "
             f"Float perplexity: {base if base is None else f'{base:.3f}'}.\n",
             "| tool | version | quantize wall s | quantize CPU s | peak RSS while quantizing (MB) "
             "| RSS growth (MB) | perplexity | change vs float |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") == "ok":
            ch = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else "-"
            lines.append(f"| {r['tool']} | {r.get('version', '?')} | {r['quant_s']:.1f} | {_num(r.get('quant_cpu_s'))} | "
                         f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['rss_before_mb']:.0f} | {r['ppl']:.3f} | {ch} |")
        else:
            lines.append(f"| {r['tool']} | {r.get('version', '-')} | failed: {r.get('error', '?')[:160]} | | | | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    (work / f"summary-{a.scheme}.json").write_text(json.dumps(rows, indent=2))
    if not a.no_results:
        header = "" if RESULTS.exists() else "# Benchmarks\n\nAppended by the scripts under bench/.\n"
        with open(RESULTS, "a") as f:
            f.write(header + text)


if __name__ == "__main__":
    main()
