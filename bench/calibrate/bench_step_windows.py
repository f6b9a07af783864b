"""Windows per reconstruction step against perplexity and time, side by side (issue 35).

For each scheme, each ``--sizes`` value (``reconstruct_batch_size``: 0 for one whole calibration
batch a step, else windows a step) and each ``--shifts`` value (which 16 of the built-in
calibration text's 512-token windows: 0 is lowbit's own evenly spaced choice, k shifts every
index by k windows, a second calibration draw), quantizes the built-in SmolLM2-135M with
``lowbit.quantize``'s defaults otherwise and scores perplexity on the first 1024 tokens of the
built-in evaluation text (the main job's figure) and on all of it (512-token windows).

    .venv/bin/python bench/calibrate/bench_step_windows.py [--schemes nvfp4,nvfp4-e5m3]
        [--sizes 0,1] [--shifts 0,2] [--out rows.jsonl]

One JSON line per row (wall and CPU seconds of the quantization, the calibration's phases,
the steps each layer kept, load average); figures in bench/calibrate/RESULTS-calibrate.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

import lowbit
from lowbit.calibration.config import CalibrationError
from lowbit.calibration.inputs import token_ids
from lowbit.calibration.windows import spaced
from lowbit.eval.perplexity import perplexity
from lowbit.textfiles import builtin_calibration_text_path, read_paragraphs
from lowbit.textstart import bos_to_prepend, prepend


def calibration(tok, shift: int, n: int = 16, seq_len: int = 512):
    """"builtin" for shift 0, else the built-in text's windows with every index shifted."""
    if shift == 0:
        return "builtin"
    text = "\n".join(read_paragraphs(builtin_calibration_text_path(), kind="calibration", error=CalibrationError))
    ids = torch.tensor(token_ids(tok, text))
    bos = bos_to_prepend(tok)
    span = seq_len - (bos is not None)
    n_win = ids.numel() // span
    idx = (spaced(n_win, n) + shift).clamp(max=n_win - 1)
    return prepend(ids[: n_win * span].reshape(n_win, span)[idx], bos)


def scores(model, tok, limit: int | None = None) -> tuple[float, float, int]:
    """Perplexity on the first 1024 evaluation tokens and on ``limit`` of them (None: the whole text)."""
    short = perplexity(model, tok, limit=1024, progress=False).perplexity
    whole = perplexity(model, tok, limit=limit, progress=False)
    return short, whole.perplexity, whole.tokens_scored


def float_row(model, tok, limit: int | None = None) -> dict:
    """The float model's row (both perplexities), printed."""
    short, whole, n = scores(model, tok, limit)
    row = {"row": "float", "ppl1024": short, "ppl_all": whole, "tokens": n, "load": os.getloadavg()}
    print(json.dumps(row), flush=True)
    return row


def add_row(rows: list, row: dict, out: str) -> None:
    """Append ``row``, print it and rewrite ``out`` (one JSON line per row) with every row so far."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="nvfp4,nvfp4-e5m3")
    ap.add_argument("--sizes", default="0,1")
    ap.add_argument("--shifts", default="0,2")
    ap.add_argument("--out", default="step-windows.jsonl")
    a = ap.parse_args()
    model, tok = lowbit.load_model()
    model.eval()
    rows = [float_row(model, tok)]
    for shift in map(int, a.shifts.split(",")):
        for scheme in a.schemes.split(","):
            for size in map(int, a.sizes.split(",")):
                m = copy.deepcopy(model)
                t0, c0 = time.perf_counter(), time.process_time()
                q = lowbit.quantize(m, scheme, calibration=calibration(tok, shift), tokenizer=tok, progress=False,
                                    reconstruct_batch_size=size or None)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                short, whole, n = scores(q, tok)
                rec = q.lowbit_calibration.reconstruct
                add_row(rows, {"scheme": scheme, "windows_a_step": size or "batch", "shift": shift, "wall": wall,
                               "cpu": cpu, "ppl1024": short, "ppl_all": whole, "tokens": n,
                               "phases": q.lowbit_calibration.cost.as_dict(),
                               "best_steps": sorted({r["best_step"] for r in rec.values()}), "load": os.getloadavg()},
                        a.out)
                del q, m


if __name__ == "__main__":
    main()
