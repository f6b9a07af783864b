"""Benchmark model-free quantization against the I/O floor: a plain safetensors copy.

    .venv/bin/python bench/modelfree/bench_modelfree.py                      # SmolLM2 + a ~2.3 GB synthetic model
    .venv/bin/python bench/modelfree/bench_modelfree.py --synthetic-gb 0 --schemes w4a16
    .venv/bin/python bench/modelfree/bench_modelfree.py --skip-smollm2 --synthetic-gb 0.08 --synthetic-shape small \
        --workers 1 --autoround-python /tmp/lowbit-peers/auto-round/bin/python --autoround-variants default,rtn

For each checkpoint (SmolLM2-135M-Instruct re-saved as bf16 shards, and a synthetic
TinyLlama-1.1B-shaped bf16 checkpoint of random weights, or one of smaller layers) it runs, each in
its own process:
- copy: every shard read with safetensors ``load_file`` and written with ``save_file`` (the floor);
- model-free: ``lowbit.quantize_checkpoint`` for each scheme;
- with --autoround-python: auto-round's model-free mode for the same schemes (AR_SCHEMES), run by
  the interpreter of its own environment (offline), per option set (AR_VARIANTS), with a timeout.
  Compare the outputs kept with --keep-outputs with bench/modelfree/compare_autoround.py.
It reports the time of the operation itself (measured inside the process, imports excluded; with
--repeat N the median of N runs, each in a fresh process, and their range),
throughput in GB of source per second, and peak RSS: the sum over the process and its workers,
sampled every 50 ms, and the largest single process (ru_maxrss). Files come from the page cache
in every run (a warm-up copy runs first), so the comparison is compute + write against read +
write. The synthetic checkpoint is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

COPY_CHILD = r"""
import json, sys, time
from pathlib import Path
from safetensors.torch import load_file, save_file
from safetensors import safe_open
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True)
import resource
cpu0 = sum(getattr(resource.getrusage(resource.RUSAGE_SELF), k) for k in ("ru_utime", "ru_stime"))
t0 = time.perf_counter()
for f in sorted(src.glob("*.safetensors")):
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    save_file(load_file(str(f)), str(out / f.name), metadata=meta)
for f in src.iterdir():
    if f.suffix != ".safetensors":
        (out / f.name).write_bytes(f.read_bytes())
import resource
ru = resource.getrusage
s, c = ru(resource.RUSAGE_SELF), ru(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": time.perf_counter() - t0, "maxrss": 1024 * max(s.ru_maxrss, c.ru_maxrss),
                  "cpu": s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime - cpu0}))
"""

MF_CHILD = r"""
import json, sys, time
import lowbit
quantize_checkpoint = lowbit.quantize_checkpoint  # import lowbit is lazy: torch and model-free load here, not timed
import resource
device = sys.argv[5] or None if len(sys.argv) > 5 else None
extra = {}
if len(sys.argv) > 6:  # workers given as "Np" / "Nt": force worker processes / threads in this process
    pool_bytes, pool_workers = int(sys.argv[6]), 2 if sys.argv[6] == "0" else 1 << 30
    try:
        from lowbit.modelfree import RunOptions
        extra["run_options"] = RunOptions(pool_min_bytes=pool_bytes, pool_min_workers=pool_workers)
    except ImportError:  # an older tree (--compare-src): its module constants
        import lowbit.modelfree.run
        lowbit.modelfree.run.POOL_MIN_BYTES, lowbit.modelfree.run.POOL_MIN_WORKERS = pool_bytes, pool_workers
if device:  # CUDA context creation is start-up, not work
    import torch
    torch.zeros(1, device=device)
cpu0 = sum(getattr(resource.getrusage(resource.RUSAGE_SELF), k) for k in ("ru_utime", "ru_stime"))
t0 = time.perf_counter()
quantize_checkpoint(sys.argv[1], sys.argv[2], scheme=sys.argv[3], format="lowbit",
                           workers=int(sys.argv[4].rstrip("pt")), progress=False,
                           **({"device": device} if device else {}), **extra)
import resource
ru = resource.getrusage
s, c = ru(resource.RUSAGE_SELF), ru(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": time.perf_counter() - t0, "maxrss": 1024 * max(s.ru_maxrss, c.ru_maxrss),
                  "cpu": s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime - cpu0}))
"""

# auto-round's model-free mode, run by the python of its own environment. argv: src, out, SCHEME, options
# (JSON: AutoRound keyword arguments, plus "format" for quantize_and_save). Its shard workers are
# spawned processes, terminated without being waited for (not in RUSAGE_CHILDREN): run_measured adds
# their CPU time as sampled to "cpu_self".
AR_CHILD = r"""
import json, sys, time, resource
src, out, scheme, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
fmt = opts.pop("format", "auto_round")
from auto_round import AutoRound
cpu0 = sum(getattr(resource.getrusage(resource.RUSAGE_SELF), k) for k in ("ru_utime", "ru_stime"))
t0 = time.perf_counter()
AutoRound(model=src, scheme=scheme, model_free=True, **opts).quantize_and_save(out, format=fmt)
ru = resource.getrusage
s, c = ru(resource.RUSAGE_SELF), ru(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": time.perf_counter() - t0, "maxrss": 1024 * max(s.ru_maxrss, c.ru_maxrss),
                  "cpu": s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime - cpu0,
                  "cpu_self": s.ru_utime + s.ru_stime - cpu0}))
"""

# lowbit scheme -> auto-round preset. Same rules: w4a16 (group 128, symmetric, the signed extreme at
# -8: lowbit's "full-range" observer; auto-round rounds the scale to fp16), mxfp4/mxfp8 (OCP MX);
# nvfp4-e5m3 (group 16, UE5M3 scales). auto-round's W8A16 is group 128 where lowbit's w8a16 is per
# channel (not the same scheme: compared for speed only).
AR_SCHEMES = {"w4a16": "W4A16", "w8a16": "W8A16", "mxfp4": "MXFP4", "mxfp8": "MXFP8", "nvfp4-e5m3": "NVFP4_E5M3"}
# auto-round option sets ("variants"): its defaults (torch.compile on, the optimised-RTN scale search for
# the MX and NVFP4-E5M3 schemes), and plain RTN without torch.compile (the rule lowbit applies). Through
# AutoRound(...), disable_opt_rtn reaches the model-free compressor only together with iters=0.
AR_VARIANTS = {"default": {}, "rtn": {"iters": 0, "disable_opt_rtn": True, "enable_torch_compile": False}}


def run_measured(code: str, args: list[str], lowbit_src: str | None = None, python: str | None = None,
                 extra_env: dict | None = None, timeout: float | None = None) -> dict:
    """Run a child python; returns its reported seconds, wall time, peak RSS (tree sum, max single).
    ``lowbit_src``: import lowbit from this source folder (PYTHONPATH) instead of the default.
    ``python``: another interpreter; ``extra_env``: added to the environment; ``timeout``: seconds,
    after which the child's process group is killed and {"timed_out": True, ...} returned."""
    env = dict(os.environ, **(extra_env or {}))
    if lowbit_src:
        env["PYTHONPATH"] = lowbit_src
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen([python or sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT, env=env, start_new_session=True)
    peak_sum = peak_pss = 0
    cpu_seen: dict[int, float] = {}  # pid -> user + system CPU seconds at its last sample
    stop = threading.Event()

    def pss(q: psutil.Process) -> int:
        try:
            return q.memory_full_info().pss  # shared pages (torch's libraries) counted once
        except (psutil.AccessDenied, AttributeError, OSError):
            return q.memory_info().rss

    def sample() -> None:
        nonlocal peak_sum, peak_pss
        try:
            proc = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = total_pss = 0
            try:
                for q in [proc] + proc.children(recursive=True):
                    try:
                        total += q.memory_info().rss
                        total_pss += pss(q)
                        t = q.cpu_times()
                        cpu_seen[q.pid] = t.user + t.system
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            peak_sum, peak_pss = max(peak_sum, total), max(peak_pss, total_pss)
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # the child and the workers it started (its own session)
        p.communicate()
        stop.set()
        th.join()
        wall = time.perf_counter() - t0
        return dict(timed_out=True, seconds=wall, wall=wall, cpu=sum(cpu_seen.values()), maxrss=0,
                    peak_rss_sum=peak_sum, peak_pss_sum=peak_pss, load=load)
    stop.set()
    th.join()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}): {err.decode()[-3000:]}")
    res = json.loads(out.decode().strip().splitlines()[-1])
    if "cpu_self" in res:  # workers that were never waited for (not in RUSAGE_CHILDREN): their sampled CPU
        res["cpu"] = max(res["cpu"], res["cpu_self"] + sum(c for pid, c in cpu_seen.items() if pid != p.pid))
    res.update(wall=wall, peak_rss_sum=peak_sum, peak_pss_sum=peak_pss, load=load)
    return res


def source_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def linear_weights(folder: Path) -> int:
    """Elements of the 2-D ``*.weight`` tensors both tools quantize (embeddings and lm_head excluded)."""
    n = 0
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as h:
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        for name, info in header.items():
            shape = info["shape"] if name != "__metadata__" else []
            if name.endswith(".weight") and len(shape) == 2 and "embed" not in name and "lm_head" not in name:
                n += shape[0] * shape[1]
    return n


def prepare_smollm2(work: Path) -> Path:
    """SmolLM2-135M-Instruct (the built-in model, expanded from its GGUF) as bf16 shards of ~64 MB."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.models.builtin import ensure_builtin

    dst = work / "smollm2-bf16"
    if dst.exists():
        return dst
    model = AutoModelForCausalLM.from_pretrained(str(ensure_builtin()), dtype=torch.bfloat16)
    model.save_pretrained(dst, max_shard_size="64MB")
    return dst


# synthetic checkpoint shapes: hidden, intermediate, vocab, key/value width, attention heads, kv heads, shard MB.
# "small" is for slow tools (auto-round): ~11 M linear weights a layer, 8 M-weight embeddings, 40 MB shards.
SHAPES = {"tinyllama": (2048, 5632, 32000, 512, 32, 4, 450), "small": (1024, 2816, 8192, 256, 16, 4, 40)}


def prepare_synthetic(work: Path, gb: float, shape: str = "tinyllama") -> Path:
    """A bf16 checkpoint of random weights shaped like TinyLlama-1.1B (or SHAPES[shape]), layers scaled to ``gb``."""
    import torch
    from safetensors.torch import save_file

    H, I, V, KV, heads, kv_heads, shard_mb = SHAPES[shape]
    per_layer = 2 * (H * H + H * KV) + 3 * H * I
    layers = max(1, round((gb * 1e9 / 2 - 2 * V * H) / per_layer))
    dst = work / f"synthetic-{shape}-{layers}l"
    if dst.exists():
        return dst
    dst.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (V, H))]
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors += [(f"{p}.self_attn.q_proj.weight", (H, H)), (f"{p}.self_attn.k_proj.weight", (KV, H)),
                    (f"{p}.self_attn.v_proj.weight", (KV, H)), (f"{p}.self_attn.o_proj.weight", (H, H)),
                    (f"{p}.mlp.gate_proj.weight", (I, H)), (f"{p}.mlp.up_proj.weight", (I, H)),
                    (f"{p}.mlp.down_proj.weight", (H, I)), (f"{p}.input_layernorm.weight", (H,)),
                    (f"{p}.post_attention_layernorm.weight", (H,))]
    tensors += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nb = 2 * int(torch.tensor(shape).prod())
        if shards[-1] and size + nb > shard_mb * 2**20:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nb
    wm = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: rnd(*s) if len(s) == 2 else torch.ones(s, dtype=torch.bfloat16) for n, s in shard},
                  str(dst / fname), metadata={"format": "pt"})
        wm.update({n: fname for n, _ in shard})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(2 * int(torch.tensor(s).prod()) for _, s in tensors)}, "weight_map": wm}))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "vocab_size": V,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "dtype": "bfloat16", "hidden_act": "silu"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def prepare(kind: str, work: Path, gb: float, shape: str = "tinyllama") -> Path:
    r = subprocess.run([sys.executable, __file__, "--prepare", kind, "--work", str(work), "--synthetic-gb", str(gb),
                        "--synthetic-shape", shape], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"preparing {kind} failed: {r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


@dataclass
class AutoRoundJobs:
    """auto-round's model-free jobs: the interpreter of its environment, variants (AR_VARIANTS keys),
    workers (AR_MODEL_FREE_SHARD_PARALLELISM: processes, one shard each at a time), intra-op threads
    per process (OMP_NUM_THREADS), the timeout of one job in seconds."""
    python: str
    variants: list[str]
    workers: list[int]
    threads: int = 1
    timeout: float = 1800.0


def keep_or_remove(out: Path, keep_dir: Path | None, name: str) -> None:
    """Move the output folder to keep_dir/name (for comparing outputs afterwards), else delete it."""
    if keep_dir is None or not out.exists():
        shutil.rmtree(out, ignore_errors=True)
        return
    dst = keep_dir / name
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(out), str(dst))


def median_run(repeat: int, once) -> dict:
    """``once()`` (one measured run in a fresh process) ``repeat`` times: the run of median time,
    with every run's time in ``times`` (runs of a 0.2 s job vary by +-0.1 s on a shared machine)."""
    results = [once(k) for k in range(max(1, repeat))]
    times = [r["seconds"] for r in results]
    best = sorted(results, key=lambda r: r["seconds"])[(len(results) - 1) // 2]
    return dict(best, times=times)


def lowbit_jobs(src: Path, scheme: str, runs: list, out: Path, keep_dir: Path | None, repeat: int = 1) -> list[dict]:
    rows = []
    for lowbit_src, code, ws, dev in runs:
        for w in ws:
            force = {"p": ["0"], "t": [str(1 << 62)]}.get(str(w)[-1], [])
            extra = [dev or ""] + force

            def once(k: int) -> dict:
                if k:
                    shutil.rmtree(out, ignore_errors=True)
                return run_measured(MF_CHILD, [str(src), str(out), scheme, str(w)] + extra, lowbit_src)

            r = median_run(repeat, once)
            out_gb = source_bytes(out) / 1e9
            keep_or_remove(out, keep_dir if code == "this tree" and not dev else None, f"lowbit-{scheme}-w{w}")
            rows.append(dict(job=f"model-free {scheme}", tool="lowbit", scheme=scheme, workers=w, **r,
                             out_gb=out_gb, code=code))
            print(rows[-1], flush=True)
    return rows


def autoround_jobs(src: Path, scheme: str, ar: AutoRoundJobs, out: Path, keep_dir: Path | None) -> list[dict]:
    rows = []
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(ar.threads),
           "PYTHONPATH": ""}
    for variant in ar.variants:
        opts = dict(AR_VARIANTS[variant], format="auto_round")
        for w in ar.workers:
            r = run_measured(AR_CHILD, [str(src), str(out), AR_SCHEMES[scheme], json.dumps(opts)], python=ar.python,
                             extra_env=dict(env, AR_MODEL_FREE_SHARD_PARALLELISM=str(w)), timeout=ar.timeout)
            out_gb = source_bytes(out) / 1e9 if out.exists() and not r.get("timed_out") else float("nan")
            keep_or_remove(out, None if r.get("timed_out") else keep_dir, f"autoround-{variant}-{scheme}-w{w}")
            rows.append(dict(job=f"auto-round {AR_SCHEMES[scheme]}", tool="auto-round", scheme=scheme, workers=w,
                             **r, out_gb=out_gb, code=variant))
            print(rows[-1], flush=True)
    return rows


def bench_model(label: str, src: Path, schemes: list[str], workers: list[int], work: Path,
                compare: tuple[str, list[int]] | None = None, device: str | None = None,
                ar: AutoRoundJobs | None = None, keep_dir: Path | None = None, repeat: int = 1) -> list[dict]:
    """The copy floor, then per scheme lowbit's jobs and auto-round's (``ar``), one at a time.
    ``keep_dir``: keep the outputs of this tree's CPU jobs and auto-round's there (one folder each)."""
    rows = []
    nbytes = source_bytes(src)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    run_measured(COPY_CHILD, [str(src), str(out)])  # warm the page cache
    shutil.rmtree(out)

    def copy_once(k: int) -> dict:
        r = run_measured(COPY_CHILD, [str(src), str(out)])
        shutil.rmtree(out)
        return r

    r = median_run(repeat, copy_once)
    rows.append(dict(job="safetensors copy", tool="copy", scheme="", workers=1, **r, code=""))
    print(rows[-1], flush=True)
    runs = [(None, "this tree", workers, "")] + ([(compare[0], "before", compare[1], "")] if compare else [])
    runs += [(None, f"this tree, {device}", [1], device)] if device else []
    for scheme in schemes:
        rows += lowbit_jobs(src, scheme, runs, out, keep_dir, repeat)
        if ar is not None:
            rows += autoround_jobs(src, scheme, ar, out, keep_dir)
    gweights = linear_weights(src) / 1e9
    for row in rows:
        row.update(model=label, gb=nbytes / 1e9, gbps=nbytes / 1e9 / row["seconds"], gweights=gweights,
                   vs_copy=row["seconds"] / rows[0]["seconds"])
    return rows


def vs_lowbit(rows: list[dict], r: dict, key: str) -> str:
    """auto-round's ``key`` (seconds, cpu) over lowbit's (this tree, same model, scheme and workers);
    a lower bound ("> N") for a job that timed out."""
    ref = [q for q in rows if q["tool"] == "lowbit" and q["code"] == "this tree" and q["model"] == r["model"]
           and q["scheme"] == r["scheme"] and str(q["workers"]) == str(r["workers"])]
    if r["tool"] != "auto-round" or not ref or (r.get("timed_out") and key != "seconds"):
        return ""
    return ("> " if r.get("timed_out") else "") + f"{r[key] / ref[0][key]:.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | source GB | job | code | workers | time s | runs | CPU s | wall s (with imports) | GB/s | x copy | "
             "x lowbit (time) | x lowbit (CPU) | CPU s per G weights | peak PSS, all processes | peak RSS sum | peak RSS, largest process "
             "| load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"> {r['seconds']:.0f} (timeout)" if r.get("timed_out") else f"{r['seconds']:.2f}"
        times = r.get("times") or [r["seconds"]]
        spread = f"{len(times)}: {min(times):.2f}-{max(times):.2f}" if len(times) > 1 else "1"
        lines.append(f"| {r['model']} | {r['gb']:.2f} | {r['job']} | {r.get('code', '')} | {r['workers']} | {t} | {spread} | "
                     f"{r.get('cpu', float('nan')):.1f} | {r['wall']:.1f} | {r['gbps']:.3f} | {r['vs_copy']:.1f} | "
                     f"{vs_lowbit(rows, r, 'seconds')} | {vs_lowbit(rows, r, 'cpu')} | "
                     f"{r.get('cpu', float('nan')) / r['gweights'] if r['tool'] != 'copy' else float('nan'):.0f} | "
                     f"{r.get('peak_pss_sum', float('nan')) / 2**30:.2f} GiB | {r['peak_rss_sum'] / 2**30:.2f} GiB | "
                     f"{r.get('maxrss', 0) / 2**30:.2f} GiB | {r.get('load', float('nan')):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="nvfp4-e5m3,w4a16")
    ap.add_argument("--workers", default="1,2", help="workers values to run (1: in this process; 'Np': N worker "
                    "processes even below RunOptions.pool_min_bytes / pool_min_workers, 'Nt': N "
                    "threads in this process even above them)")
    ap.add_argument("--compare-src", default=None,
                    help="also run the model-free jobs with lowbit imported from this src folder (e.g. an "
                         "export of main: git archive main src | tar -x -C /tmp/base), labelled 'before'")
    ap.add_argument("--compare-workers", default="2", help="workers values for the --compare-src runs")
    ap.add_argument("--device", default=None, help="also run every model-free job with device=DEVICE (e.g. cuda)")
    ap.add_argument("--synthetic-gb", type=float, default=2.3)
    ap.add_argument("--synthetic-shape", choices=sorted(SHAPES), default="tinyllama",
                    help="layer shapes of the synthetic checkpoint ('small': for auto-round, ~0.08 GB)")
    ap.add_argument("--autoround-python", default=None,
                    help="also run auto-round's model-free mode with this interpreter (of its own environment)")
    ap.add_argument("--autoround-variants", default="default",
                    help=f"auto-round option sets, comma-separated: {', '.join(AR_VARIANTS)}")
    ap.add_argument("--autoround-workers", default="1", help="AR_MODEL_FREE_SHARD_PARALLELISM values")
    ap.add_argument("--autoround-threads", type=int, default=1, help="OMP_NUM_THREADS of auto-round's processes")
    ap.add_argument("--autoround-timeout", type=float, default=1800.0, help="seconds; a job is killed after it")
    ap.add_argument("--keep-outputs", default=None,
                    help="keep the CPU outputs of lowbit (this tree) and auto-round here, one folder per job")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the copy and each lowbit job this many times (fresh processes): the median is reported")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--prepare", choices=["smollm2", "synthetic"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:  # runs in a child, so the measured children never inherit its memory high-water mark
        work = Path(args.work)
        dst = prepare_smollm2(work) if args.prepare == "smollm2" else \
            prepare_synthetic(work, args.synthetic_gb, args.synthetic_shape)
        print(dst)
        return
    schemes = args.schemes.split(",")
    workers = args.workers.split(",")
    compare = (str(Path(args.compare_src).resolve()), [int(w) for w in args.compare_workers.split(",")]) \
        if args.compare_src else None
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="lowbit-bench-mf-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"scratch: {work}; cpus: {os.cpu_count()}; load average at start: {os.getloadavg()}", flush=True)
    ar = AutoRoundJobs(args.autoround_python, args.autoround_variants.split(","),
                       [int(w) for w in args.autoround_workers.split(",")], args.autoround_threads,
                       args.autoround_timeout) if args.autoround_python else None
    keep = Path(args.keep_outputs) if args.keep_outputs else None
    rows = []
    try:
        if not args.skip_smollm2:
            rows += bench_model("SmolLM2-135M bf16", prepare("smollm2", work, 0), schemes, workers, work,
                                compare, args.device, ar, keep and keep / "smollm2", args.repeat)
        if args.synthetic_gb > 0:
            shape = "" if args.synthetic_shape == "tinyllama" else f" ({args.synthetic_shape})"
            src = prepare("synthetic", work, args.synthetic_gb, args.synthetic_shape)
            rows += bench_model(f"synthetic {args.synthetic_gb:g} GB bf16{shape}", src, schemes, workers, work,
                                compare, args.device, ar, keep and keep / src.name, args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
