"""Calibrating on chat-formatted data vs prose, evaluated on chat-formatted held-out text.

The chat data are built offline from the built-in texts: consecutive paragraph pairs become a
user turn (one of a few prompts + a paragraph) and an assistant turn (the next paragraph),
rendered with SmolLM2-135M-Instruct's own chat template (which adds its default system prompt).
Calibration: Emma (lowbit's built-in calibration text), as prose (``calibration="builtin"``) or as
conversations (a JSONL file of ``messages``, through ``lowbit.quantize(calibration=PATH)``).
Evaluation: Persuasion (lowbit's built-in evaluation text) rendered as conversations, perplexity
over ``--limit`` tokens in 512-token windows. nvfp4 runs with RTN weights and no reconstruction
(labelled; its default GPTQ + 20 steps takes 7+ minutes here).

    PYTHONPATH=src .venv/bin/python bench/calibrate/bench_chat_data.py --rows w8a8-int8 --limit 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

import lowbit
from lowbit.eval.perplexity import perplexity
from lowbit.models import load_model, resolve_model_path
from lowbit.textfiles import builtin_calibration_text_path, builtin_evaluation_text_path

PROMPTS = ("Continue the story from this passage:\n\n{p}",
           "What happens next? Here is the passage:\n\n{p}",
           "Write the paragraph that follows this one, in the same style.\n\n{p}",
           "{p}\n\nGo on with the story.")

ROWS = {  # name -> (scheme, calibration options)
    "w8a8-int8": ("w8a8-int8", {}),
    "nvfp4-rtn": ("nvfp4", {"weight_rounding": "rtn", "reconstruct_iters": 0}),
    "nvfp4": ("nvfp4", {}),  # its default: GPTQ + 20 reconstruction steps
}


def conversations(paragraphs: list[str]) -> list[dict]:
    """Paragraph pairs as user/assistant turns (a pure function of the text)."""
    paras = [p for p in paragraphs if len(p) > 40]
    return [{"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)].format(p=paras[2 * i])},
                          {"role": "assistant", "content": paras[2 * i + 1]}]}
            for i in range(len(paras) // 2)]


def read(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="w8a8-int8,nvfp4-rtn")
    ap.add_argument("--limit", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--float", action="store_true", help="also evaluate the float model")
    ap.add_argument("--pad", action="store_true", help="also calibrate on padded chat windows")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(resolve_model_path(None))
    tmp = Path(tempfile.mkdtemp(prefix="lowbit-chat-"))
    calib_chat = tmp / "emma-chat.jsonl"
    calib_chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(read(builtin_calibration_text_path()))),
                          encoding="utf-8")
    evals = conversations(read(builtin_evaluation_text_path()))
    eval_text = "\n".join(tok.apply_chat_template(c["messages"], tokenize=False) for c in evals)
    results = []

    def evaluate(m, label: str, extra: dict) -> None:
        t0 = time.perf_counter()
        r = perplexity(m, tok, text=eval_text, window=512, limit=a.limit, progress=False)
        row = {"row": label, "chat_ppl": r.perplexity, "tokens": r.tokens_scored,
               "eval_s": round(time.perf_counter() - t0, 1), **extra}
        results.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    if a.float:
        evaluate(model, "float", {})
    for name in a.rows.split(","):
        scheme, opts = ROWS[name]
        variants = [("prose", "builtin", {}), ("chat", str(calib_chat), {})]
        if a.pad:
            variants.append(("chat-padded", str(calib_chat), {"pack": False}))
        for data, calib, more in variants:
            t0 = time.perf_counter()
            q = lowbit.quantize(copy.deepcopy(model), scheme, calibration=calib, tokenizer=tok, progress=False,
                                num_samples=a.samples, seq_len=a.seq_len, **opts, **more)
            info = q.lowbit_calibration.data
            evaluate(q, f"{name} / {data}", {"quant_s": round(time.perf_counter() - t0, 1),
                                             "calib_tokens": info["tokens"], "packing": info["packing"],
                                             "template": info["chat_template"]})
            del q


if __name__ == "__main__":
    main()
