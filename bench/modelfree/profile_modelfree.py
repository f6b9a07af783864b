"""Where model-free quantization spends its time, per stage of one tensor, reference vs fast path.

    PYTHONPATH=src .venv/bin/python bench/modelfree/profile_modelfree.py                  # 4 schemes, 1 thread
    PYTHONPATH=src .venv/bin/python bench/modelfree/profile_modelfree.py --schemes w4a16 --threads 2

One bf16 weight of TinyLlama's MLP shape [5632, 2048] (11.5 M elements) is written to a
safetensors file (read back from the page cache), then each stage of lowbit.modelfree's work on
it is timed (best of --repeat): read, to float32, NaN/Inf check, amax + scales (the rest of
``_prepare``), divide, encode, zero-scale mask, layout tensors (packing + scale encoding), write.
"reference" runs the functions as they were before the fast path (isfinite pass, the format's
``encode``, ``torch.where`` mask, the old nibble packing); "fast" runs what ``lowbit.quant.quantize``
did before the native kernels (run here with them switched off). "native" runs the C path
(lowbit.kernels.native, lowbit.quant.native_quant): one pass for the per-group amax with the
NaN/Inf flag, the scale rules in torch on the amaxes, one fused divide + encode pass, native
nibble packing and scale encoding in the layout; "whole" is the worker's quantize_rows + layout.
All produce the same bytes (asserted here). Times are CPU seconds of this process (robust to
other load on the machine). Also: the start-up of a worker process (spawn + imports), measured
as a fresh interpreter importing lowbit.modelfree.worker.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.formats import get_layout
from lowbit.modelfree.outshape import Entry, ShardFile
from lowbit.files.folder import DTYPE_NAMES
from lowbit.files.regions import RegionWriter, create_shard_file
from lowbit.kernels import Implementation, codes as kcodes, using
from lowbit.kernels.native import build as native_build
from lowbit.quant import QuantizedTensor, check_finite, native_quant, quantize
from lowbit.quant import qdq as S
from lowbit.schemes import get_scheme


def best(f, repeat: int):
    t, r = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        r = f()
        t = min(t, time.process_time() - t0)
    return t * 1e3, r


def profile_native(scheme_name: str, w: torch.Tensor, gs, repeat: int) -> dict[str, float]:
    """CPU ms of the native stages on ``w`` (bands of the worker's size), and the whole path."""
    from lowbit.kernels import native
    from lowbit.numerics import get_format
    from lowbit.modelfree.bands import BAND_ELEMS, quantize_rows
    from lowbit.quant.scale_rules import effective_scale, scales_from_amax

    scheme = get_scheme(scheme_name)
    spec = scheme.weights
    layout = get_layout("lowbit")
    if not native_quant.supports(w, spec):
        return {}
    g = spec.group_size or w.shape[-1]
    out: dict[str, float] = {}
    out["amax"], (a, _) = best(lambda: native.group_amax(w, g), repeat)
    out["scales"], scale = best(lambda: scales_from_amax(a, spec, gs), repeat)
    eff = effective_scale(scale, spec, gs).contiguous()
    out["encode"], _ = best(lambda: native.encode(w, g, eff, get_format(spec.format)), repeat)
    pack = layout.nibble_packed(scheme, w.shape[-1])  # the worker's fused encode + pack
    qt = quantize_rows(w, spec, gs, "w", BAND_ELEMS, pack=pack)
    out["layout"], _ = best(lambda: layout.linear_tensors("w", qt, scheme, dtype=w.dtype), repeat)
    out["whole"], _ = best(lambda: layout.linear_tensors("w", quantize_rows(w, spec, gs, "w", BAND_ELEMS, pack=pack),
                                                         scheme, dtype=w.dtype), repeat)
    return out


def old_check_finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError("non-finite")


def old_pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    if bool((codes > 15).any()):
        raise ValueError("codes above 15")
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def profile(scheme_name: str, path: Path, out_dir: Path, repeat: int) -> list[tuple[str, float, float]]:
    scheme = get_scheme(scheme_name)
    spec = scheme.weights
    layout = get_layout("lowbit")
    rows: list[tuple[str, float, float]] = []

    def both(stage: str, ref_f, fast_f=None):
        tr, r = best(ref_f, repeat)
        tf, f = best(fast_f, repeat) if fast_f is not None else (tr, r)
        rows.append((stage, tr, tf))
        return r, f

    def read():
        with safe_open(str(path), "pt") as h:
            return h.get_tensor("w")

    w, _ = both("read (safe_open, page cache)", read)
    x32, _ = both("to float32", lambda: w.to(torch.float32))
    both("NaN/Inf check", lambda: old_check_finite(w), lambda: check_finite(w, "w"))
    gs = S.global_scale_from_amax(x32.abs().amax(), spec) if spec.global_scale else None
    t_prep, p = best(lambda: S._prepare(w, spec, None, gs, "w"), repeat)
    t_fin, _ = best(lambda: check_finite(w, "w"), repeat)
    t_f32, _ = best(lambda: w.to(torch.float32), repeat)
    rest = max(0.0, t_prep - t_fin - t_f32)
    rows.append(("amax + scales (rest of _prepare)", rest, rest))
    scaled, _ = both("divide by the scales", lambda: p.v / p.divisor)
    ref_codes, fast_codes = both("encode", lambda: p.fmt.encode(scaled), lambda: kcodes.encode(p.fmt, scaled))
    assert torch.equal(ref_codes, fast_codes)

    def old_mask():
        return torch.where(p.nonzero.unsqueeze(-1), ref_codes, torch.zeros_like(ref_codes))

    def new_mask():
        c = fast_codes.clone() if not bool(p.nonzero.all()) else fast_codes
        if c is not fast_codes:
            c.masked_fill_(~p.nonzero.unsqueeze(-1), 0)
        return c

    both("zero-scale mask", old_mask, new_mask)
    qt = quantize(w, spec, global_scale=gs)
    codes = S.ungroup(ref_codes, p.n)
    assert torch.equal(codes, qt.codes)

    def old_layout():
        q = QuantizedTensor(qt.codes, qt.scale, spec, qt.zero_point, qt.global_scale)
        t = {}
        if spec.bits == 4:
            t["w.weight_packed"] = old_pack_nibbles(q.codes)
        else:
            t["w.weight_codes"] = q.codes.contiguous()
        if spec.scale_format.value != "fp32":
            from lowbit.numerics import get_format
            t["w.weight_scale"] = get_format(spec.scale_format).encode(q.scale)
        return t

    ref_t, fast_t = both("layout tensors (pack, scale codes)", old_layout,
                         lambda: layout.linear_tensors("w", qt, scheme, dtype=w.dtype))
    for k, v in ref_t.items():
        assert torch.equal(v, fast_t[k]), k

    def write():
        entries = [Entry(k, DTYPE_NAMES[v.dtype], tuple(v.shape), v.numel() * v.element_size())
                   for k, v in fast_t.items()]
        sf = ShardFile.of(entries)
        create_shard_file(out_dir / "o.safetensors", sf.header, sf.size)
        wr = RegionWriter(out_dir / "o.safetensors", sf.offsets[0], entries)
        for k, v in fast_t.items():
            wr.add(k, v)
        wr.finish()

    both("write (in place)", write)
    def reference_whole():
        old_check_finite(w)
        q = S._prepare(w, spec, None, gs, "w")
        c = q.fmt.encode(q.v / q.divisor)
        c = S.ungroup(torch.where(q.nonzero.unsqueeze(-1), c, torch.zeros_like(c)), q.n)
        t = {"w.weight_packed" if spec.bits == 4 else "w.weight_codes":
             old_pack_nibbles(c) if spec.bits == 4 else c.contiguous()}
        if spec.scale_format.value != "fp32":
            from lowbit.numerics import get_format
            t["w.weight_scale"] = get_format(spec.scale_format).encode(q.scale)
        return t

    both("whole: quantize + layout", reference_whole,
         lambda: layout.linear_tensors("w", quantize(w, spec, global_scale=gs), scheme, dtype=w.dtype))
    return rows


def startup_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import lowbit.modelfree.worker"], check=True, env=os.environ.copy())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="nvfp4-e5m3,w4a16,w8a8-fp8-dynamic,mxfp4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="lowbit-prof-") as d:
        d = Path(d)
        w = (torch.randn(5632, 2048, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        save_file({"w": w}, str(d / "w.safetensors"))
        n = w.numel()
        print(f"native library: {native_build.library()} {native_build.unavailable_reason() or ''}")
        for s in args.schemes.split(","):
            with using(Implementation.TORCH):
                rows = profile(s, d / "w.safetensors", d, args.repeat)
            spec = get_scheme(s).weights
            gs = S.global_scale_from_amax(w.float().abs().amax(), spec) if spec.global_scale else None
            nat = profile_native(s, w, gs, args.repeat)
            stage_native = {"NaN/Inf check": "(in amax)", "to float32": "(fused)",
                            "amax + scales (rest of _prepare)": f"{nat.get('amax', 0):.1f} + {nat.get('scales', 0):.1f}",
                            "divide by the scales": "(fused)", "encode": f"{nat.get('encode', 0):.1f}",
                            "zero-scale mask": "(fused)", "layout tensors (pack, scale codes)": f"{nat.get('layout', 0):.1f}",
                            "whole: quantize + layout": f"{nat.get('whole', 0):.1f}"}
            print(f"\n### {s}: one bf16 weight [5632, 2048] ({n / 1e6:.1f} M elements)\n")
            print("| stage | reference ms | fast ms | native ms |\n|---|---|---|---|")
            for stage, r, f in rows:
                print(f"| {stage} | {r:.1f} | {f:.1f} | {stage_native.get(stage, f'{f:.1f}') if nat else '-'} |")
            whole_r, whole_f = rows[-1][1], rows[-1][2]
            wn = f"{n / nat['whole'] / 1e3:.0f}" if nat else "-"
            print(f"| **M weights/s (quantize + layout)** | {n / whole_r / 1e3:.0f} | {n / whole_f / 1e3:.0f} | {wn} |")
    print(f"\nworker start-up (fresh interpreter importing lowbit.modelfree.worker): {startup_seconds():.2f} s; "
          f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
