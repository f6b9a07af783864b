"""lowbit's GGUF files against llama.cpp's own quantizer, scored by llama.cpp itself.

For one float model (default: lowbit's built-in SmolLM2-135M, expanded to float32):

1. a float32 GGUF of it through lowbit's writer (llama.cpp's converter's metadata and layout);
2. per mix (Q4_K_M, Q3_K_M, Q2_K by default):
   - lowbit without an importance matrix and ``llama-quantize`` without one: the two files must hold
     the same type and the same bytes for every tensor (lowbit's encoders are llama.cpp's reference);
   - ``llama-imatrix`` on the calibration text, then ``llama-quantize --imatrix``, against lowbit with
     its importance matrix from the same text;
3. every file scored by ``llama-perplexity --kl-divergence`` against the float32 file's logits on the
   evaluation text: mean KLD, same top token, perplexity; file size and quantization time.

    python bench/gguf/bench_gguf.py --llama /tmp/llama/.../build/bin --out bench/gguf/out

The llama.cpp tools come from the llama-cpp-python 0.3.36 source distribution (../shared/README.md:
``cmake --build build --target llama-quantize llama-imatrix llama-perplexity``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "text"


def text_file(src: Path, dest: Path, max_chars: int) -> Path:
    """The first ``max_chars`` characters of ``src`` (whole paragraphs) as a plain text file."""
    out, n = [], 0
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(line.strip())
            n += len(line)
        if n >= max_chars:
            break
    dest.write_text("\n".join(out) + "\n", encoding="utf-8")
    return dest


def prepare(out: str, model: str | None, calib_chars: int, eval_chars: int) -> tuple[Path, Path, Path, Path]:
    """(the output folder, made; the float model's folder, default the built-in; calib.txt from
    Emma; eval.txt from Persuasion) of a bench run, torch on two threads."""
    import torch

    from lowbit.models import resolve_model_path

    torch.set_num_threads(2)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    return (d, resolve_model_path(model), text_file(SHARED / "emma.txt", d / "calib.txt", calib_chars),
            text_file(SHARED / "persuasion.txt", d / "eval.txt", eval_chars))


def run(cmd: list[str], log: Path) -> tuple[str, float]:
    """Run a llama.cpp tool; its output (stdout + stderr) and seconds. RuntimeError with the log's tail."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    secs = time.perf_counter() - t0
    out = p.stdout + p.stderr
    log.write_text(" ".join(cmd) + "\n\n" + out)
    if p.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({p.returncode}): {out[-2000:]}")
    return out, secs


def kld_figures(out: str) -> dict:
    """llama-perplexity --kl-divergence's summary: mean KLD, same top p, PPL(Q), with their ±."""
    def grab(label: str):
        m = re.search(re.escape(label) + r"\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)", out)
        return (float(m.group(1)), float(m.group(2))) if m else (None, None)
    kld, kld_pm = grab("Mean    KLD")
    top, top_pm = grab("Same top p")
    ppl, ppl_pm = grab("Mean PPL(Q)")
    return {"kld": kld, "kld_pm": kld_pm, "same_top": top, "same_top_pm": top_pm, "ppl": ppl, "ppl_pm": ppl_pm}


def gguf_tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (type name, raw bytes) of every tensor of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in r.tensors}


def compare_files(ours: Path, theirs: Path) -> dict:
    """How many tensors have the same type and the same bytes in both files."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    same_type = sum(a[n][0] == b[n][0] for n in a if n in b)
    same_bytes = sum(a[n] == b[n] for n in a if n in b)
    differ = [n for n in a if n in b and a[n] != b[n]][:5]
    return {"tensors": len(a), "in_both": len(set(a) & set(b)), "same_type": same_type, "same_bytes": same_bytes,
            "differ": differ}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama", required=True, help="folder with llama-quantize, llama-imatrix, llama-perplexity")
    ap.add_argument("--model", default=None, help="float HF folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--out", default="bench/gguf/out")
    ap.add_argument("--mixes", default="Q4_K_M,Q3_K_M,Q2_K")
    ap.add_argument("--calib-chars", type=int, default=60000)
    ap.add_argument("--calib-chunks", type=int, default=16, help="calibration windows of --ctx tokens, both tools")
    ap.add_argument("--eval-chars", type=int, default=60000)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokenizer-from", default=None, help="a GGUF file whose tokenizer keys the files take "
                    "(a model expanded from a published GGUF, e.g. Gemma-3-270M)")
    a = ap.parse_args()

    from lowbit.calibration import CalibrationConfig
    from lowbit.files.folder import SafetensorsFolder
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.gguf_quantize import quantize_gguf
    from lowbit.formats.gguf.writer import write_gguf

    out, src, calib, evalt = prepare(a.out, a.model, a.calib_chars, a.eval_chars)
    tools = Path(a.llama)
    rows, checks = [], {}

    t0 = time.perf_counter()
    f32 = out / "model-f32.gguf"
    write_gguf(plan_gguf(src, tokenizer_from=a.tokenizer_from), f32, SafetensorsFolder(src), {})
    rows.append({"file": "float32 (lowbit writer)", "size": f32.stat().st_size, "seconds": time.perf_counter() - t0})
    base = out / "base.kld"
    res, _ = run([str(tools / "llama-perplexity"), "-m", str(f32), "-f", str(evalt), "-c", str(a.ctx), "-t", "2",
                  "--kl-divergence-base", str(base)], out / "ppl-f32.log")
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", res)
    rows[-1].update({"ppl": float(m.group(1)) if m else None, "ppl_pm": float(m.group(2)) if m else None})
    imatrix = out / "imatrix.gguf"
    _, t_imatrix = run([str(tools / "llama-imatrix"), "-m", str(f32), "-f", str(calib), "-c", str(a.ctx), "-t", "2",
                        "--chunks", str(a.calib_chunks), "-o", str(imatrix), "--no-ppl"], out / "imatrix.log")

    def score(path: Path, label: str, seconds: float) -> None:
        res, _ = run([str(tools / "llama-perplexity"), "-m", str(path), "-t", "2", "--kl-divergence-base", str(base),
                      "--kl-divergence"], out / f"kld-{path.stem}.log")
        rows.append({"file": label, "size": path.stat().st_size, "seconds": seconds, **kld_figures(res)})

    for mix in a.mixes.split(","):
        ours = out / f"lowbit-{mix}.gguf"
        r = quantize_gguf(src, ours, mix, overwrite=True, progress=False, tokenizer_from=a.tokenizer_from)
        theirs = out / f"llama-{mix}.gguf"
        _, t_q = run([str(tools / "llama-quantize"), str(f32), str(theirs), mix, "2"], out / f"quantize-{mix}.log")
        checks[mix] = compare_files(ours, theirs)
        score(theirs, f"llama-quantize {mix} (no importance matrix)", t_q)
        score(ours, f"lowbit {mix} (no importance)", r.seconds)
        theirs_i = out / f"llama-{mix}-imatrix.gguf"
        _, t_qi = run([str(tools / "llama-quantize"), "--imatrix", str(imatrix), str(f32), str(theirs_i), mix, "2"],
                      out / f"quantize-{mix}-imatrix.log")
        score(theirs_i, f"llama-imatrix + llama-quantize {mix}", t_imatrix + t_qi)
        for search, rounding, label in (
                ("llama-cpp", "rtn", "llama.cpp's importance search, its own codes"),
                ("llama-cpp", "gptq", "llama.cpp's importance search, then GPTQ codes"),
                ("direct", "rtn", "direct importance search, its own codes"),
                ("direct", "gptq", "direct importance search, then GPTQ codes (default)")):
            ours_i = out / f"lowbit-{mix}-{search}-{rounding}.gguf"
            r = quantize_gguf(src, ours_i, mix, calibration=str(calib), overwrite=True, progress=False,
                              tokenizer_from=a.tokenizer_from, importance_search=search,
                              config=CalibrationConfig(num_samples=a.calib_chunks, seq_len=a.ctx,
                                                       weight_rounding=rounding))
            score(ours_i, f"lowbit {mix} ({label})", r.seconds)
    (out / "results.json").write_text(json.dumps({"rows": rows, "checks": checks}, indent=2))
    lines = ["| file | size (MB) | KLD ± | same top % | PPL ± | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        kld = f"{r['kld']:.5f} ± {r['kld_pm']:.5f}" if r.get("kld") is not None else "-"
        top = f"{r['same_top']:.2f}" if r.get("same_top") is not None else "-"
        ppl = f"{r['ppl']:.3f} ± {r['ppl_pm']:.3f}" if r.get("ppl") is not None else "-"
        lines.append(f"| {r['file']} | {r['size'] / 1e6:.1f} | {kld} | {top} | {ppl} | {r['seconds']:.1f} |")
    lines += ["", "| mix | tensors | same type as llama-quantize | same bytes |", "|---|---|---|---|"]
    for mix, c in checks.items():
        lines.append(f"| {mix} | {c['tensors']} | {c['same_type']} | {c['same_bytes']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
