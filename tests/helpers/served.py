"""The tiny models, prompts and scores shared by the vLLM serving test (tests/serving) and
bench/serve/serve_schemes.py: random 2-layer models whose linear sides are multiples of 128 and whose
head size vLLM's CPU attention has kernels for, random prompts, and lowbit's side of each
comparison (log-probabilities, greedy continuations, perplexity)."""

from __future__ import annotations

import math

import torch

from helpers.models import tiny_llama, tiny_qwen3

CFG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)
MODELS = {"llama": lambda: tiny_llama(seed=0, **CFG), "qwen3": lambda: tiny_qwen3(seed=0, head_dim=64, **CFG)}
SEQ, N_PROMPTS = 96, 3


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG["vocab_size"], (SEQ,), generator=g).tolist() for _ in range(N_PROMPTS)]


def calibration_ids() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(5))


def logprobs(model, ids_list) -> list[list[float]]:
    """Per prompt: log p(ids[t] | ids[:t]) for t >= 1, from the model's float32 log-softmax."""
    out = []
    with torch.no_grad():
        for ids in ids_list:
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            out.append(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist())
    return out


def greedy(model, ids_list, n: int) -> list[list[int]]:
    """Per prompt: n greedy tokens, each from a full forward of the sequence so far."""
    out = []
    with torch.no_grad():
        for ids in ids_list:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].float().argmax()))
            out.append(seq[len(ids):])
    return out


def perplexity(lps) -> float:
    flat = [x for lp in lps for x in lp]
    return math.exp(-math.fsum(flat) / len(flat))


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))
