#!/usr/bin/env python
"""GPU check of lowbit's Triton kernels: bit-exactness against the CPU reference, and timings.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python bench/gpu/gpu_check.py --out DIR      # on a CUDA GPU
    PYTHONPATH=src python bench/gpu/gpu_check.py --cpu-dry-run --out /tmp/x      # rehearsal on a CPU

(a) Bit-exactness, GPU vs lowbit.quant on the CPU: activation quantization (codes, block
    scales, scale codes, QDQ in float32 and bfloat16) for NVFP4, NVFP4-E5M3, MXFP4, MXFP8 and
    per-token / per-tensor INT8 and FP8, on the adversarial sets of lowbit.backends.triton_conformance
    (ties, binade edges, subnormal UE5M3 scales, the E8M0 2^-127 scale, zero blocks, float32
    subnormals, the largest finite values) and on random Llama-sized tensors; weight
    dequantization from the packed layouts; the PTX audit for this device; and, for
    information, whether lowbit.quant itself run on CUDA tensors equals its CPU results.
(b) Timings (median of triton.testing.do_bench) at Llama-8B layer shapes (4096x4096,
    14336x4096, 4096x14336; M = 16 and 4096): each kernel against the reference path (the
    same lowbit.quant functions run with torch ops on the GPU) and each backend's linear
    against bf16 F.linear, with achieved bandwidth against the measured copy bandwidth and
    the card's nominal 4.8 TB/s.

Every check runs in its own try/except; results are written to DIR/gpu_check.json and
DIR/gpu_check.md after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

DRY = "--cpu-dry-run" in sys.argv
if DRY:  # must precede any import of triton (it reads the variable when it decorates kernels)
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NOMINAL_BW = 4.8e12  # H200 HBM3e, bytes/s (datasheet)
RESULTS: dict = {"env": {}, "ceilings": {}, "ptx": {}, "exact": {}, "exact_errors": {}, "timing": [],
                 "errors": [], "notes": []}
OUTDIR = "."
DEADLINE = float("inf")  # --max-wall: checks that would start later are skipped (recorded)


def log(*a):
    print(*a, flush=True)


def save():
    os.makedirs(OUTDIR, exist_ok=True)
    tmp = os.path.join(OUTDIR, "gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(tmp, os.path.join(OUTDIR, "gpu_check.json"))
    tmp = os.path.join(OUTDIR, "gpu_check.md.tmp")
    with open(tmp, "w") as f:
        f.write(markdown())
    os.replace(tmp, os.path.join(OUTDIR, "gpu_check.md"))


def guarded(label):
    def deco(fn):
        def run(*a, **k):
            t = time.time()
            if t > DEADLINE:
                RESULTS.setdefault("skipped_for_time", []).append(label)
                return None
            try:
                out = fn(*a, **k)
                log(f"[ok] {label} ({time.time() - t:.1f}s)")
                return out
            except Exception as e:  # keep going: record and continue with the next check
                tb = traceback.format_exc(limit=6)
                RESULTS["errors"].append({"check": label, "error": repr(e), "traceback": tb})
                log(f"[ERROR] {label}: {e!r}\n{tb}")
            finally:
                save()
        return run
    return deco


# ---------------------------------------------------------------------------- timing helpers
def bench(fn, dev) -> float:
    """Median milliseconds of fn()."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


def record(group, name, shape, ms, nbytes=None, flops=None, baseline_ms=None, **extra):
    row = {"group": group, "name": name, "shape": shape, "ms": round(ms, 5)}
    if nbytes:
        row["GB/s"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
        row["%nominal"] = round(100 * nbytes / (ms * 1e-3) / NOMINAL_BW, 1)
        cbw = RESULTS["ceilings"].get("copy_GBps")
        if cbw:
            row["%copy"] = round(100 * nbytes / (ms * 1e-3) / 1e9 / cbw, 1)
    if flops:
        row["TFLOP/s"] = round(flops / (ms * 1e-3) / 1e12, 1)
    if baseline_ms:
        row["speedup_vs_ref"] = round(baseline_ms / ms, 2)
    row.update(extra)
    RESULTS["timing"].append(row)
    log(f"  {group:>10} {name:<34} {str(shape):<22} {ms:9.4f} ms "
        + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("group", "name", "shape", "ms")))


# ---------------------------------------------------------------------------- sections
def env_info(dev):
    import triton

    e = RESULTS["env"]
    e.update(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
             device=str(dev), dry_run=DRY)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        e.update(name=p.name, capability=list(torch.cuda.get_device_capability(dev)), sms=p.multi_processor_count,
                 mem_GiB=round(p.total_memory / 2**30, 1))
    log("env:", e)


@guarded("ceilings")
def ceilings(dev):
    if dev.type != "cuda":
        return
    n = 1 << 30  # 1 GiB read + 1 GiB written
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), dev)
    RESULTS["ceilings"]["copy_GBps"] = round(2 * n / (ms * 1e-3) / 1e9, 1)
    a = b = None  # free the 2 GiB
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = bench(lambda: x @ x, dev)
    RESULTS["ceilings"]["bf16_mm_TFLOPs"] = round(2 * 8192**3 / (ms * 1e-3) / 1e12, 1)
    log("ceilings:", RESULTS["ceilings"])


@guarded("ptx audit")
def ptx(dev):
    if dev.type != "cuda":
        return
    from lowbit.kernels.ptx_audit import _compile, variants, violations, FLOAT_OP

    cap = torch.cuda.get_device_capability(dev)
    found = {}
    for name, fn, sig, cx in variants():
        found[name] = sorted(set(FLOAT_OP.findall(_compile(fn, sig, cx, cap[0] * 10 + cap[1]))))
    RESULTS["ptx"] = {"instructions": found, "violations": violations(found)}


def _exact(label, fn):
    t = time.time()
    try:
        res = fn()
        RESULTS["exact"][label] = res
        bad = {k: v for k, v in res.items() if v}
        log(f"[{'EXACT' if not bad else 'MISMATCH'}] {label} ({time.time() - t:.1f}s) {bad if bad else ''}")
    except Exception as e:
        RESULTS["exact_errors"][label] = repr(e)
        RESULTS["errors"].append({"check": label, "error": repr(e), "traceback": traceback.format_exc(limit=6)})
        log(f"[ERROR] {label}: {e!r}")
    save()


def exactness(dev, big):
    from lowbit.backends import triton_conformance as C
    from lowbit.quant import quantize
    from lowbit.schemes import get_scheme

    g = torch.Generator().manual_seed(1)
    for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8"):
        spec = get_scheme(name).input_activations
        x = C.adversarial_blocks(spec, seed=3, n_random=512)
        _exact(f"act[{name}] adversarial {tuple(x.shape)}", lambda: C.check_block_quant(spec, x, dev))
        M, K = big
        xr = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-20, 20, (M, 1), generator=g).float())
        xr[0, :] = 0.0  # an all-zero row
        _exact(f"act[{name}] random {tuple(xr.shape)}", lambda: C.check_block_quant(spec, xr, dev))
        w = get_scheme(name).weights
        qt = C.random_microscaled_weight(w, big[0], big[1], seed=5)
        _exact(f"dequant[{name}] random codes {big}", lambda: C.check_microscaled_dequant(qt, dev))
        wq = quantize(torch.randn(*big, generator=g) * 0.02, w)
        _exact(f"dequant[{name}] quantized randn {big}", lambda: C.check_microscaled_dequant(wq, dev))
    for name in ("w8a8-int8-dynamic", "w8a8-fp8-dynamic", "w8a8-int8", "w8a8-fp8"):
        spec = get_scheme(name).input_activations
        x, scales = C.adversarial_rows(spec, K=512, seed=3)
        sc = scales if spec.dynamic.value == "static" else (None,)
        _exact(f"act[{name}] adversarial {tuple(x.shape)}", lambda: C.check_row_quant(spec, x, dev, sc))
        xr = torch.randn(*big, generator=g) * 3
        sc2 = (torch.tensor([0.05]),) if spec.dynamic.value == "static" else (None,)
        _exact(f"act[{name}] random {tuple(xr.shape)}", lambda: C.check_row_quant(spec, xr, dev, sc2))
    from lowbit.schemes import QuantSpec
    for label, spec in (("w4a16", get_scheme("w4a16").weights), ("w8a16", get_scheme("w8a16").weights),
                        ("int4-asym-g64", QuantSpec("int4", "group", 64, symmetric=False))):
        wq = quantize(torch.randn(big[0], big[1] - 64, generator=g) * 0.02, spec)  # K-64: a ragged last group
        _exact(f"dequant[{label}] {tuple(wq.codes.shape)}", lambda: C.check_int_dequant(wq, dev))


@guarded("lowbit.quant on CUDA vs CPU (information)")
def reference_on_cuda(dev, big):
    """Is lowbit.quant itself bit-exact when run with torch ops on CUDA tensors?"""
    from lowbit.backends import triton_conformance as C
    from lowbit.quant import quantize
    from lowbit.schemes import get_scheme

    out = {}
    for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "w8a8-int8-dynamic", "w8a8-fp8-dynamic"):
        spec = get_scheme(name).input_activations
        x = torch.randn(*big) * 3
        if spec.is_microscaled:
            x = torch.cat([x.reshape(-1, spec.group_size), C.adversarial_blocks(spec, n_random=0)])
        gs = torch.tensor([37.3]) if spec.global_scale else None
        a = quantize(x, spec, global_scale=gs)
        b = quantize(x.to(dev), spec, global_scale=None if gs is None else gs.to(dev))
        out[name] = {"codes": C.count_diff(b.codes, a.codes), "scale": C.count_diff(b.scale, a.scale)}
    RESULTS["reference_on_cuda_vs_cpu"] = out
    log("lowbit.quant on CUDA vs CPU mismatches:", out)


@guarded("backends end to end")
def backends_e2e(dev):
    from lowbit.backends import use_backend
    from lowbit.backends.reference import ReferenceBackend
    from lowbit.modules import QuantLinear
    from lowbit.quant import global_scale_from_amax, static_scale_from_amax
    from lowbit.schemes import get_scheme

    out = {}
    for name in ("nvfp4", "nvfp4a16", "nvfp4-e5m3", "mxfp4", "mxfp8", "w4a16", "w8a16",
                 "w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic"):
        try:
            torch.manual_seed(0)
            lin = torch.nn.Linear(1024, 512, bias=True)
            sch = get_scheme(name)
            a = sch.input_activations
            kw = {}
            if a is not None and a.global_scale:
                kw["input_global_scale"] = global_scale_from_amax(torch.tensor(6.0), a)
            if a is not None and a.dynamic.value == "static":
                kw["input_scale"] = static_scale_from_amax(torch.tensor(6.0), a)
            m = QuantLinear.from_linear(lin, sch, name="l", **kw)
            x = torch.randn(64, 1024) * 1.5
            ref = ReferenceBackend().forward(m, x)  # on the CPU
            m = m.to(dev)
            counts = use_backend(m, "auto")
            r = {"backend": next(iter(counts))}
            for dt in (torch.float32, torch.bfloat16):
                y = m(x.to(dev, dt)).float().cpu()
                r[f"relerr_{str(dt).split('.')[-1]}"] = float((y - ref).norm() / ref.norm())
            out[name] = r
        except Exception as e:
            out[name] = {"error": repr(e)}
    RESULTS["backends"] = out
    log("backends:", json.dumps(out, indent=0))


def timings(dev, shapes, Ms):
    from lowbit.backends.gpu_w8a8 import FP8MMBackend, Int8MMBackend
    from lowbit.backends.reference import ReferenceBackend
    from lowbit.backends.triton_mx import TritonBackend
    from lowbit.kernels.actquant import quantize_blocks, quantize_rows
    from lowbit.kernels.dequant import dequantize_int, dequantize_microscaled, pack_int, pack_microscaled
    from lowbit.modules import QuantLinear
    from lowbit.quant import dequantize, global_scale_from_amax, quantize, static_scale_from_amax
    from lowbit.schemes import get_scheme

    cap_fp8 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
    done_act: set = set()
    for (N, K) in shapes:
        # ---- weight dequantization from packed layouts: kernel vs lowbit.dequantize (torch ops)
        for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "w4a16", "w8a16"):
            @guarded(f"time dequant {name} {N}x{K}")
            def _dq():
                spec = get_scheme(name).weights
                w = torch.randn(N, K, device=dev) * 0.02
                qt = quantize(w, spec)
                if spec.is_microscaled:
                    data, sc = pack_microscaled(qt.codes, qt.scale, spec)
                    fn = lambda: dequantize_microscaled(data, sc, spec, qt.global_scale, out_features=N,  # noqa: E731
                                                        in_features=K, dtype=torch.bfloat16)
                    nbytes = data.numel() + sc.numel() + 2 * N * K
                else:
                    data = pack_int(qt.codes, spec)
                    fn = lambda: dequantize_int(data, qt.scale, spec, qt.zero_point, out_features=N,  # noqa: E731
                                                in_features=K, dtype=torch.bfloat16)
                    nbytes = data.numel() * data.element_size() + qt.scale.numel() * 4 + 2 * N * K
                ref_ms = bench(lambda: dequantize(qt, torch.bfloat16), dev)
                record("dequant", f"{name} ref(torch ops)", (N, K), ref_ms)
                record("dequant", f"{name} triton", (N, K), bench(fn, dev), nbytes=nbytes, baseline_ms=ref_ms)
            _dq()
        for M in Ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            # ---- activation quantization: kernel vs lowbit.quantize on the GPU (torch ops)
            for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "w8a8-int8-dynamic", "w8a8-fp8-dynamic",
                         "w8a8-int8"):
                if (name, M, K) in done_act:
                    continue  # activation quantization depends on (M, K) only
                done_act.add((name, M, K))
                @guarded(f"time act {name} M={M} K={K}")
                def _aq():
                    spec = get_scheme(name).input_activations
                    gs = torch.tensor([2688.0 / 5.0], device=dev) if spec.global_scale else None
                    st = torch.tensor([0.04], device=dev) if spec.dynamic.value == "static" else None
                    ref_ms = bench(lambda: quantize(x, spec, scale=st, global_scale=gs), dev)
                    record("act-quant", f"{name} ref(torch ops)", (M, K), ref_ms)
                    if spec.is_microscaled:
                        fn = lambda: quantize_blocks(x, spec, gs, check_finite=False)  # noqa: E731
                        nbytes = M * K * 2 + M * K + 5 * M * K // spec.group_size
                        fq = lambda: quantize_blocks(x, spec, gs, codes=False, qdq_dtype=torch.bfloat16,  # noqa: E731
                                                     check_finite=False)
                        record("act-quant", f"{name} triton codes", (M, K), bench(fn, dev), nbytes=nbytes,
                               baseline_ms=ref_ms)
                        record("act-quant", f"{name} triton qdq->bf16", (M, K), bench(fq, dev), nbytes=4 * M * K)
                        record("act-quant", f"{name} triton codes+check", (M, K),
                               bench(lambda: quantize_blocks(x, spec, gs), dev), nbytes=nbytes)
                    else:
                        fn = lambda: quantize_rows(x, spec, st, check_finite=False)  # noqa: E731
                        nbytes = M * K * 2 * (2 if st is None else 1) + M * K + 4 * M
                        record("act-quant", f"{name} triton", (M, K), bench(fn, dev), nbytes=nbytes, baseline_ms=ref_ms)
                _aq()
            # ---- linear layers: backend forward vs bf16 F.linear
            w16 = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
            base_ms = bench(lambda: F.linear(x, w16), dev)
            record("linear", "bf16 F.linear", (M, N, K), base_ms, nbytes=2 * (M * K + N * K + M * N),
                   flops=2 * M * N * K)
            for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "nvfp4a16", "w4a16",
                         "w8a8-int8-dynamic", "w8a8-int8", "w8a8-fp8-dynamic", "w8a8-fp8"):
                @guarded(f"time linear {name} M={M} N={N} K={K}")
                def _lin():
                    sch = get_scheme(name)
                    a = sch.input_activations
                    if name.startswith("w8a8-fp8") and not cap_fp8:
                        return
                    lin = torch.nn.Linear(K, N, bias=False, device=dev)
                    kw = {}
                    if a is not None and a.global_scale:
                        kw["input_global_scale"] = global_scale_from_amax(torch.tensor(5.0, device=dev), a)
                    if a is not None and a.dynamic.value == "static":
                        kw["input_scale"] = static_scale_from_amax(torch.tensor(5.0, device=dev), a)
                    m = QuantLinear.from_linear(lin, sch, name="l", **kw)
                    if name.startswith("w8a8-int8"):
                        be = Int8MMBackend(check_finite=False)
                    elif name.startswith("w8a8-fp8"):
                        be = FP8MMBackend(check_finite=False)
                    else:
                        be = TritonBackend(check_finite=False)
                    ms = bench(lambda: be.forward(m, x), dev)
                    extra = {}
                    if M == Ms[0] or N * K <= 4096 * 4096:
                        extra["ref_ms"] = round(bench(lambda: ReferenceBackend().forward(m, x), dev), 4)
                    wbytes = {"nvfp4": 0.5625, "nvfp4-e5m3": 0.5625, "mxfp4": 0.53125, "mxfp8": 1.03125,
                              "nvfp4a16": 0.5625, "w4a16": 0.53125}.get(name, 1.0)
                    record("linear", f"{name} {be.name}", (M, N, K), ms,
                           nbytes=int(wbytes * N * K + 2 * M * K + 2 * M * N), flops=2 * M * N * K,
                           vs_bf16=round(base_ms / ms, 2), **extra)
                    if be.name == "triton" and M <= 64 and get_scheme(name).weights.is_microscaled:
                        be2 = TritonBackend(check_finite=False, fused_max_m=64)  # the opt-in fused matmul
                        ms2 = bench(lambda: be2.forward(m, x), dev)
                        record("linear", f"{name} triton fused (opt-in)", (M, N, K), ms2,
                               nbytes=int(wbytes * N * K + 2 * M * K + 2 * M * N), flops=2 * M * N * K,
                               vs_bf16=round(base_ms / ms2, 2))
                _lin()


def sweep(dev, M=4096, N=14336, K=4096):
    """Tile sizes of each kernel at one large shape (to choose the defaults)."""
    from lowbit.kernels.actquant import quantize_blocks, quantize_rows
    from lowbit.kernels.dequant import dequantize_int, dequantize_microscaled, pack_int, pack_microscaled
    from lowbit.quant import quantize
    from lowbit.schemes import get_scheme

    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    spec = get_scheme("nvfp4").input_activations
    gs = torch.tensor([2688.0 / 5.0], device=dev)
    for bn in (64, 128, 256):
        guarded(f"sweep act bn={bn}")(lambda: record(
            "sweep", f"act nvfp4 codes block_n={bn}", (M, K),
            bench(lambda: quantize_blocks(x, spec, gs, check_finite=False, block_n=bn), dev),
            nbytes=M * K * 2 + M * K + 5 * M * K // 16))()
    rspec = get_scheme("w8a8-int8-dynamic").input_activations
    for bm, bk in ((8, 512), (2, 2048), (4, 1024), (8, 1024)):
        guarded(f"sweep rows {bm}x{bk}")(lambda: record(
            "sweep", f"act int8 per-token block_m={bm} block_k={bk}", (M, K),
            bench(lambda: quantize_rows(x, rspec, check_finite=False, block_m=bm, block_k=bk), dev),
            nbytes=M * K * 4 + M * K))()
    w = get_scheme("nvfp4").weights
    qt = quantize(torch.randn(N, K, device=dev) * 0.02, w)
    data, sc = pack_microscaled(qt.codes, qt.scale, w)
    for bn in (128, 256, 512):
        guarded(f"sweep dequant bn={bn}")(lambda: record(
            "sweep", f"dequant nvfp4 block_n={bn}", (N, K),
            bench(lambda: dequantize_microscaled(data, sc, w, qt.global_scale, out_features=N, in_features=K,
                                                 block_n=bn), dev), nbytes=data.numel() + sc.numel() + 2 * N * K))()
    from lowbit.kernels.matmul import mx_matmul
    x16 = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
    for bn, bk in ((128, 128), (256, 64), (64, 64), (128, 256)):
        guarded(f"sweep fused {bn}x{bk}")(lambda: record(
            "sweep", f"fused nvfp4 matmul M=16 block_n={bn} block_k={bk}", (16, N, K),
            bench(lambda: mx_matmul(x16, data, sc, w, qt.global_scale, out_features=N, block_n=bn, block_k=bk), dev),
            nbytes=data.numel() + sc.numel() + 2 * 16 * (N + K)))()
    w4 = get_scheme("w4a16").weights
    q4 = quantize(torch.randn(N, K, device=dev) * 0.02, w4)
    d4 = pack_int(q4.codes, w4)
    for br, bc in ((8, 512), (4, 1024), (16, 512), (8, 1024)):
        guarded(f"sweep int4 {br}x{bc}")(lambda: record(
            "sweep", f"dequant w4a16 block_r={br} block_c={bc}", (N, K),
            bench(lambda: dequantize_int(d4, q4.scale, w4, None, out_features=N, in_features=K, block_r=br,
                                         block_c=bc), dev), nbytes=N * K // 2 + 4 * N * K // 128 + 2 * N * K))()


def markdown() -> str:
    lines = ["# lowbit GPU check", "", f"env: `{json.dumps(RESULTS['env'])}`", "",
             f"ceilings: `{json.dumps(RESULTS['ceilings'])}`", ""]
    ex = RESULTS["exact"]
    if ex:
        lines += ["## Bit-exactness vs the CPU reference (mismatching elements)", "", "| check | result |", "|---|---|"]
        for k, v in ex.items():
            bad = {a: b for a, b in v.items() if b}
            lines.append(f"| {k} | {'exact (' + str(len(v)) + ' fields)' if not bad else 'MISMATCH ' + json.dumps(bad)} |")
        for k, v in RESULTS["exact_errors"].items():
            lines.append(f"| {k} | ERROR {v} |")
        lines.append("")
    if RESULTS.get("ptx"):
        lines += ["## PTX float instructions", "", f"violations: `{json.dumps(RESULTS['ptx'].get('violations'))}`", ""]
    if RESULTS.get("reference_on_cuda_vs_cpu"):
        lines += ["## lowbit.quant run on CUDA vs on the CPU (mismatches)", "",
                  f"`{json.dumps(RESULTS['reference_on_cuda_vs_cpu'])}`", ""]
    if RESULTS.get("backends"):
        lines += ["## Backends chosen automatically, error vs CPU reference", "", "| scheme | backend | rel err fp32 | rel err bf16 |",
                  "|---|---|---|---|"]
        for k, v in RESULTS["backends"].items():
            lines.append(f"| {k} | {v.get('backend', v.get('error'))} | {v.get('relerr_float32', '')} | {v.get('relerr_bfloat16', '')} |")
        lines.append("")
    if RESULTS["timing"]:
        lines += ["## Timings (median ms)", "", "| group | kernel | shape | ms | GB/s | % of 4.8 TB/s | % of copy | TFLOP/s | vs ref | vs bf16 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in RESULTS["timing"]:
            lines.append(f"| {r['group']} | {r['name']} | {r['shape']} | {r['ms']} | {r.get('GB/s', '')} | "
                         f"{r.get('%nominal', '')} | {r.get('%copy', '')} | {r.get('TFLOP/s', '')} | "
                         f"{r.get('speedup_vs_ref', r.get('ref_ms', ''))} | {r.get('vs_bf16', '')} |")
    if RESULTS["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['check']}: {e['error']}" for e in RESULTS["errors"]]
    return "\n".join(lines) + "\n"


def main():
    global OUTDIR, DEADLINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dry-run", action="store_true", help="run everything small on the CPU (Triton interpreter)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/gpu/gpu_check_out"))
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--max-wall", type=float, default=float("inf"),
                    help="seconds after which remaining timing checks are skipped (results are kept)")
    args = ap.parse_args()
    OUTDIR = args.out
    t0 = time.time()
    DEADLINE = t0 + args.max_wall
    if args.cpu_dry_run:
        dev = torch.device("cpu")
        big, shapes, Ms = (64, 256), [(128, 256), (256, 128)], [4, 32]
    else:
        if not torch.cuda.is_available():
            log("no CUDA device: use --cpu-dry-run for a rehearsal")
            return 2
        dev = torch.device("cuda")
        big, shapes, Ms = (2048, 4096), [(4096, 4096), (14336, 4096), (4096, 14336)], [16, 4096]
    env_info(dev)
    save()
    ceilings(dev)
    ptx(dev)
    if not args.skip_exact:
        try:
            exactness(dev, big)
        except Exception as e:
            RESULTS["errors"].append({"check": "exactness", "error": repr(e), "traceback": traceback.format_exc()})
        reference_on_cuda(dev, (512, 1024))
        backends_e2e(dev)
    if not args.skip_sweep:
        try:
            if args.cpu_dry_run:
                sweep(dev, M=8, N=64, K=256)
            else:
                sweep(dev)
        except Exception as e:
            RESULTS["errors"].append({"check": "sweep", "error": repr(e), "traceback": traceback.format_exc()})
    if not args.skip_timing:
        try:
            timings(dev, shapes, Ms)
        except Exception as e:
            RESULTS["errors"].append({"check": "timings", "error": repr(e), "traceback": traceback.format_exc()})
    RESULTS["wall_s"] = round(time.time() - t0, 1)
    save()
    n_bad = sum(1 for v in RESULTS["exact"].values() if any(v.values()))
    log(f"\nDONE in {RESULTS['wall_s']} s: {len(RESULTS['exact'])} exactness checks, {n_bad} with mismatches, "
        f"{len(RESULTS['exact_errors'])} errored; {len(RESULTS['timing'])} timings; {len(RESULTS['errors'])} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
