"""lowbit's evaluation of a GGUF file against ``llama-perplexity`` on the very same tokens.

``llama-perplexity -m F.gguf -f TEXT -c 512 --kl-divergence-base BASE`` writes, after the magic
``_logits_``, n_ctx, n_vocab and n_chunk (int32 each), the n_chunk * n_ctx tokens it scored (its own
tokenization of TEXT), then its log-probabilities. This script reads those tokens, runs the file
through ``lowbit.load`` (GGML blocks kept, ``numerics`` lowbit and llama-cpp-cpu) on the same
chunks, and scores what llama-perplexity scores: in each chunk of n_ctx tokens, the predictions at
positions n_ctx/2 .. n_ctx-2 (the first token replaced by BOS when the vocabulary adds one).

    python bench/gguf/check_llama_ppl.py F.gguf BASE [--log ppl.log] [--numerics lowbit,llama-cpp-cpu]

Prints one JSON line per numerics: perplexity, per-chunk cumulative perplexities (llama-perplexity's
``[i]`` figures), seconds; with ``--log`` llama-perplexity's own figures beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import numpy as np


def read_tokens(base: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(n_ctx, tokens [n_chunk, n_ctx], llama's log-probability of each scored token [n_chunk, n_ctx/2 - 1]).
    The log-probabilities are stored as uint16 steps of (max - min logit) / 65535 above the lowest
    (at most 16 nats below the top): exact to 1.3e-4 nats for every token within 16 nats of the top."""
    with open(base, "rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{base}: not a llama-perplexity logits file")
        n_ctx = int(np.frombuffer(f.read(4), dtype=np.int32)[0])
        n_vocab, n_chunk = (int(v) for v in np.frombuffer(f.read(8), dtype=np.int32))
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).reshape(n_chunk, n_ctx).copy()
        nv = 2 * ((n_vocab + 1) // 2) + 4
        first = n_ctx // 2
        per = n_ctx - 1 - first
        rec = np.fromfile(f, dtype=np.uint16, count=n_chunk * per * nv).reshape(n_chunk, per, nv)
    head = rec[:, :, :4].copy().view(np.float32)                    # scale, min log-prob
    target = tokens[:, first + 1:]
    q = np.take_along_axis(rec[:, :, 4:], target[:, :, None].astype(np.int64), axis=2)[:, :, 0]
    return n_ctx, tokens, head[:, :, 1] + head[:, :, 0] * q.astype(np.float32)


def llama_figures(log: str) -> dict:
    text = open(log).read()
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
    chunks = [float(v) for v in re.findall(r"\[\d+\]([\d.]+)", text)]
    return {"ppl": float(m.group(1)) if m else None, "pm": float(m.group(2)) if m else None, "chunks": chunks}


def score(gguf: str, tokens: np.ndarray, n_ctx: int, numerics: str, bos: int | None, model=None) -> dict:
    import torch

    import lowbit
    from lowbit.quant.serving import ServingNumerics

    t0 = time.perf_counter()
    model = lowbit.load(gguf, numerics=ServingNumerics(numerics)) if model is None else model
    load_s = time.perf_counter() - t0
    first = n_ctx // 2
    nll, count, cumulative, lps = 0.0, 0, [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for chunk in tokens:
            ids = torch.from_numpy(chunk.astype(np.int64))[None]
            if bos is not None:
                ids[0, 0] = bos
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits[first:n_ctx - 1].double(), dim=-1)
            target = torch.from_numpy(chunk[first + 1:].astype(np.int64))
            got = lp.gather(1, target[:, None])[:, 0]
            lps.append(got.numpy())
            nll -= float(got.sum())
            count += n_ctx - 1 - first
            cumulative.append(math.exp(nll / count))
    return {"numerics": numerics, "ppl": math.exp(nll / count), "chunks": cumulative, "tokens_scored": count,
            "load_s": round(load_s, 1), "run_s": round(time.perf_counter() - t0, 1), "logprobs": np.stack(lps),
            "model": model}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("base", help="llama-perplexity --kl-divergence-base file of the same text and -c")
    ap.add_argument("--log", help="llama-perplexity's output, for its figures")
    ap.add_argument("--numerics", default="lowbit,llama-cpp-cpu")
    ap.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    ap.add_argument("--spread", type=int, default=0,
                    help="perturbed evaluations of llama-cpp-cpu (input embeddings times 1 + eps N(0, 1), "
                         "lowbit.eval.spread): how far float rounding alone moves its figures")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    n_ctx, tokens, llama_lp = read_tokens(a.base)
    if a.chunks:
        tokens, llama_lp = tokens[:a.chunks], llama_lp[:a.chunks]
    import gguf

    r = gguf.GGUFReader(a.gguf)
    add_bos = "tokenizer.ggml.add_bos_token" in r.fields and bool(r.fields["tokenizer.ggml.add_bos_token"].contents())
    bos = int(r.fields["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
    llama = llama_figures(a.log) if a.log else None
    seen = {}
    for n in a.numerics.split(","):
        res = score(a.gguf, tokens, n_ctx, n, bos)
        lp, model = res.pop("logprobs"), res.pop("model")
        if n == "llama-cpp-cpu" and a.spread:
            from lowbit.eval.spread import perturbed_embeddings

            res["spread"] = []
            for seed in range(a.spread):
                with perturbed_embeddings(model, float(np.finfo(np.float32).eps), seed):
                    p = score(a.gguf, tokens, n_ctx, n, bos, model=model)
                e = (p["logprobs"] - lp).astype(np.float64)
                res["spread"].append({"seed": seed, "ppl": p["ppl"],
                                      "per_token_rms_vs_unperturbed": float(np.sqrt((e * e).mean()))})
        del model
        d = (lp - llama_lp).astype(np.float64)
        # per token against llama-perplexity's own log-probability of the same token (stored to 1.3e-4)
        res["vs_llama_per_token"] = {"mean": float(d.mean()), "rms": float(np.sqrt((d * d).mean())),
                                     "max_abs": float(np.abs(d).max())}
        for other, olp in seen.items():
            e = (lp - olp).astype(np.float64)
            res[f"vs_{other}_per_token_rms"] = float(np.sqrt((e * e).mean()))
        seen[n] = lp
        if llama is not None:
            res["llama_ppl"], res["llama_pm"] = llama["ppl"], llama["pm"]
            k = len(res["chunks"])
            res["llama_chunks"] = llama["chunks"][:k]
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
