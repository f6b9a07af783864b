"""auto-round's GGUF export beside lowbit's and llama.cpp's rows of RESULTS-gguf.md (issue 48).

Runs with auto-round's own environment (not lowbit's), on the outputs of ``bench_gguf.py``:

    /work/.venv-ar/bin/python bench/gguf/autoround_gguf.py --bench /tmp/kq/bench \\
        --llama /tmp/llama/.../build/bin --model FLOAT_HF_FOLDER --mix q3_k_m:200 --mix q4_k_m:0

Per ``--mix NAME:ITERS`` (auto-round format ``gguf:NAME``; ``ITERS`` 0 is its optimized RTN, >0 its
tuning; ``NAME:ITERS:ext`` adds ``enable_alg_ext``): ``AutoRound(...).quantize_and_save(format=
"gguf:NAME")`` timed from the model load to the written file, then the file scored exactly like
``bench_gguf.py``'s ``score`` (``llama-perplexity -m FILE -t 2 --kl-divergence-base base.kld
--kl-divergence``, the same evaluation tokens). The calibration windows are lowbit's own: the
bench's ``calib.txt`` cut by ``lowbit.calibration.calibration_tokens`` (16 x 512 tokens by default),
computed in lowbit's environment (``--lowbit-python``) and handed to auto-round as token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gguf import kld_figures, run  # noqa: E402  (no lowbit import there at module level)


def calib_ids(python: str, model: str, text: Path, n: int, seq: int, dest: Path):
    """lowbit's calibration windows of ``text`` ([n, seq] int64) through lowbit's environment."""
    code = ("import sys, torch; from transformers import AutoTokenizer; "
            "from lowbit.calibration import calibration_tokens; "
            "tok = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "torch.save(calibration_tokens(sys.argv[2], tok, num_samples=int(sys.argv[3]), seq_len=int(sys.argv[4])), "
            "sys.argv[5])")
    subprocess.run([python, "-c", code, model, str(text), str(n), str(seq), str(dest)], check=True)
    import torch

    return torch.load(dest)


def quantize(model: str, mix: str, iters: int, alg_ext: bool, ids, seq: int, out_dir: Path) -> tuple[Path, float]:
    """auto-round's GGUF file for ``mix`` and its seconds (model load + quantize + export)."""
    import torch
    from auto_round import AutoRound

    torch.set_num_threads(2)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    t0 = time.perf_counter()
    kw = {"enable_alg_ext": True} if alg_ext else {}
    ar = AutoRound(model, scheme=f"gguf:{mix}".upper(), iters=iters, nsamples=ids.shape[0], seqlen=seq,
                   dataset=[row.unsqueeze(0) for row in ids], device_map="cpu", **kw)
    ar.quantize_and_save(output_dir=str(out_dir), format=f"gguf:{mix}")
    secs = time.perf_counter() - t0
    files = sorted(out_dir.rglob("*.gguf"))
    if len(files) != 1:
        raise RuntimeError(f"expected one GGUF file under {out_dir}, found {files}")
    return files[0], secs


def inspect(ours: Path, ref: Path, f32: Path) -> dict:
    """How ``ours`` differs from llama-quantize's file ``ref`` of the same mix (tensor names, types,
    type counts) and from the float32 file ``f32`` in its tokenizer / model metadata."""
    import collections

    import gguf

    def fields(r):
        return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}

    a, b, f = gguf.GGUFReader(ours), gguf.GGUFReader(ref), gguf.GGUFReader(f32)
    ta = {t.name: t.tensor_type.name for t in a.tensors}
    tb = {t.name: t.tensor_type.name for t in b.tensors}
    fa, ff = fields(a), fields(f)
    return {"tensors": len(ta), "only_ours": sorted(set(ta) - set(tb))[:10], "only_ref": sorted(set(tb) - set(ta))[:10],
            "same_type": sum(ta[n] == tb.get(n) for n in ta),
            "types": dict(collections.Counter(ta.values())), "ref_types": dict(collections.Counter(tb.values())),
            "differ_type": [f"{n}: {ta[n]} vs {tb[n]}" for n in ta if n in tb and ta[n] != tb[n]][:12],
            "keys_only_ours": sorted(set(fa) - set(ff)), "keys_only_f32": sorted(set(ff) - set(fa)),
            "keys_differ": sorted(k for k in set(fa) & set(ff) if k != "general.file_type" and fa[k] != ff[k])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="bench_gguf.py's --out (model-f32.gguf, base.kld, calib.txt)")
    ap.add_argument("--llama", required=True, help="folder with llama-perplexity")
    ap.add_argument("--model", required=True, help="the float HF folder the bench quantized")
    ap.add_argument("--mix", action="append", default=[], help="NAME:ITERS[:ext], e.g. q4_k_m:0, q3_k_m:200")
    ap.add_argument("--lowbit-python", default="/work/main/.venv/bin/python")
    ap.add_argument("--calib-chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tag", default="", help="suffix of the output names (e.g. -gemma)")
    ap.add_argument("--inspect", nargs=2, metavar=("OURS", "REF"), help="only compare a written file with "
                    "llama-quantize's file of the same mix and with the bench's float32 file; print as JSON")
    a = ap.parse_args()
    if a.inspect:
        print(json.dumps(inspect(Path(a.inspect[0]), Path(a.inspect[1]), Path(a.bench) / "model-f32.gguf"),
                         indent=1, default=str))
        return

    import auto_round
    import torch

    torch.set_num_threads(2)
    bench = Path(a.bench)
    work = bench / f"autoround{a.tag}"
    work.mkdir(exist_ok=True)
    ids = calib_ids(a.lowbit_python, a.model, bench / "calib.txt", a.calib_chunks, a.ctx, work / "calib_ids.pt")
    print(f"calibration: {tuple(ids.shape)} token ids from {bench / 'calib.txt'}", flush=True)
    tools = Path(a.llama)
    results = work / "results.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    for spec in a.mix:
        name, iters, *ext = spec.split(":")
        iters, alg_ext = int(iters), bool(ext and ext[0] == "ext")
        stem = f"autoround-{name}-i{iters}{'-ext' if alg_ext else ''}"
        path, secs = quantize(a.model, name, iters, alg_ext, ids, a.ctx, work / stem)
        dest = work / f"{stem}.gguf"
        shutil.move(str(path), dest)
        res, _ = run([str(tools / "llama-perplexity"), "-m", str(dest), "-t", "2", "--kl-divergence-base",
                      str(bench / "base.kld"), "--kl-divergence"], work / f"kld-{stem}.log")
        recipe = "optimized RTN" if iters == 0 else "tuning" + (" + enable_alg_ext" if alg_ext else "")
        row = {"file": f"auto-round {auto_round.__version__} gguf:{name} {recipe} (iters {iters})",
               "size": dest.stat().st_size, "seconds": secs, "load": os.getloadavg()[0], **kld_figures(res)}
        rows = [r for r in rows if r["file"] != row["file"]] + [row]
        results.write_text(json.dumps(rows, indent=2))
        print(f"| {row['file']} | {row['size'] / 1e6:.1f} | {row['kld']:.5f} ± {row['kld_pm']:.5f} | "
              f"{row['same_top']:.2f} | {row['ppl']:.3f} ± {row['ppl_pm']:.3f} | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
