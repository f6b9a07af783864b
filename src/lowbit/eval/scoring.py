"""Token log-probabilities without ever materializing full-vocabulary logits for a window.

The model's backbone gives hidden states [B, T, H]; the output head (lm_head) is applied to
chunks of positions so at most ``max_logits`` float32 logits exist at once (a 262k-vocabulary
model such as Gemma 3 would otherwise need 1 GB per 1024-token window). Each chunk yields the
log-probability of its target token (log-softmax in float32) and the greedy argmax.
"""

from __future__ import annotations

import torch
import torch.nn as nn

#: default budget of float32 logits alive at once (16M elements = 64 MiB)
DEFAULT_MAX_LOGITS = 1 << 24


def _text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    return cfg


def output_head(model: nn.Module) -> tuple[nn.Module, float | None]:
    """The module mapping hidden states to logits, and the final logit soft-cap (Gemma) or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embedding (lm_head)")
    cfg = _text_config(model)
    softcap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
    return head, softcap


def backbone(model: nn.Module) -> nn.Module:
    """The decoder that returns final (normed) hidden states: ``model.model`` for HF CausalLMs."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if dec is None or dec is model:
        raise TypeError(f"cannot find the decoder of {type(model).__name__}")
    return dec


@torch.no_grad()
def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states [B, T, H] of ``input_ids`` (no logits computed)."""
    out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h


@torch.no_grad()
def chunked_logits_apply(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                         softcap: float | None = None, max_logits: int = DEFAULT_MAX_LOGITS,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and the argmax token at each position, in chunks.

    hidden [N, H] (positions flattened), targets [N] -> (logprob [N] float32, argmax [N] int64).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden [N, H] and targets [N] expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    n = hidden.shape[0]
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    step = max(1, int(max_logits) // int(vocab))
    lps = torch.empty(n, dtype=torch.float32)
    arg = torch.empty(n, dtype=torch.long)
    for s in range(0, n, step):
        logits = head(hidden[s:s + step]).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        lse = torch.logsumexp(logits, dim=-1)
        lps[s:s + step] = (logits.gather(-1, targets[s:s + step, None].to(logits.device)).squeeze(-1) - lse).cpu()
        arg[s:s + step] = logits.argmax(-1).cpu()
        del logits, lse
    return lps, arg


@torch.no_grad()
def score_positions(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, max_logits: int = DEFAULT_MAX_LOGITS,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (batch, t) in ``positions`` [K, 2]: log p(input_ids[b, t] | input_ids[b, :t]) and
    the greedy prediction at t (from the hidden state at t-1). t must be >= 1."""
    if positions.numel() and int(positions[:, 1].min()) < 1:
        raise ValueError("position 0 has no prediction")
    dev = next(model.parameters()).device
    h = hidden_states(model, input_ids.to(dev), None if attention_mask is None else attention_mask.to(dev))
    b, t = positions[:, 0].to(dev), positions[:, 1].to(dev)
    hs = h[b, t - 1]
    targets = input_ids.to(dev)[b, t]
    head, softcap = output_head(model)
    return chunked_logits_apply(hs, head, targets, softcap, max_logits)
