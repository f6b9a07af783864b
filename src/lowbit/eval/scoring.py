"""Token log-probabilities without ever materializing full-vocabulary logits for a window.

The model's backbone gives hidden states [B, T, H]; the output head (lm_head) is applied to
chunks of positions so at most ``max_logits`` float32 logits exist at once (a 262k-vocabulary
model such as Gemma 3 would otherwise need 1 GB per 1024-token window). Each chunk yields the
log-probability of its target token (log-softmax in float32) and the greedy argmax.

``chunked_divergence`` does the same for a model and a reference (the float model) at once: the
reference's full distribution at each position is recomputed, chunk by chunk, from its final
hidden state and its own output head, so the KL divergence is the full-vocabulary one
(``kl_rows``) without any full-vocabulary logits ever being stored.
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
    step = rows_per_chunk(head, max_logits)
    lps = torch.empty(n, dtype=torch.float32)
    arg = torch.empty(n, dtype=torch.long)
    for s in range(0, n, step):
        # the target's log-probability alone: logits[t] - logsumexp, the same float operation (hence
        # the same bits) as the full log-probabilities chunked_divergence gathers from
        logits = _logits(head, hidden[s:s + step], softcap)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        lps[s:s + step] = (logits.gather(-1, targets[s:s + step, None].to(logits.device)) - lse).squeeze(-1).cpu()
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


def rows_per_chunk(head: nn.Module, max_logits: int) -> int:
    """Positions per chunk: two heads' float32 logits (a model's and its reference's) within
    ``max_logits``. One rule for every scoring function, so a position's logits are computed in
    the same chunk, hence bit for bit the same, with and without a reference."""
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    return max(1, int(max_logits) // (2 * int(vocab)))


def _logits(head: nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """float32 ``head(hidden)``, soft-capped like the model's own logits."""
    logits = head(hidden).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def log_probs(head: nn.Module, hidden: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (float32) ``logits - logsumexp(logits)`` of ``head(hidden)`` and the argmax
    of the logits."""
    logits = _logits(head, hidden, softcap)
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True), logits.argmax(-1)


def kl_rows(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_v p_v (log p_v - log q_v) per row, natural log, float64 [N], from the
    log-probabilities of P (the reference) and Q [N, V]: terms in their dtype (float32: within
    ~1e-9 of float64 terms on a 49k vocabulary, 3x faster), summed in float64. Terms with p_v = 0
    are 0."""
    p = ref_logprobs.exp()
    terms = torch.where(p > 0, p * (ref_logprobs - logprobs), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(-1, dtype=torch.float64)


@torch.no_grad()
def chunked_divergence(hidden: torch.Tensor, head: nn.Module, softcap: float | None, targets: torch.Tensor,
                       ref_hidden: torch.Tensor, ref_head: nn.Module, ref_softcap: float | None,
                       max_logits: int = DEFAULT_MAX_LOGITS) -> dict[str, torch.Tensor]:
    """Per position (rows of ``hidden`` [N, H] and ``ref_hidden`` [N, H'], the same tokens): the
    model's log-probability of ``targets`` and argmax, the reference's, and KL(reference || model).
    Both heads run on chunks of at most ``max_logits`` logits together. Tensors on the CPU:
    logprob, ref_logprob float32; argmax, ref_argmax int64; kld float64."""
    n = hidden.shape[0]
    if ref_hidden.shape[0] != n or targets.shape != (n,):
        raise ValueError(f"{n} positions, reference {ref_hidden.shape[0]}, targets {tuple(targets.shape)}")
    step = rows_per_chunk(head, max_logits)
    out = {"logprob": torch.empty(n), "argmax": torch.empty(n, dtype=torch.long), "ref_logprob": torch.empty(n),
           "ref_argmax": torch.empty(n, dtype=torch.long), "kld": torch.empty(n, dtype=torch.float64)}
    for s in range(0, n, step):
        lq, top_q = log_probs(head, hidden[s:s + step], softcap)
        lp, top_p = log_probs(ref_head, ref_hidden[s:s + step].to(lq.device), ref_softcap)
        lp = lp.to(lq.device)
        if lp.shape != lq.shape:
            raise ValueError(f"the reference's vocabulary ({lp.shape[-1]}) is not the model's ({lq.shape[-1]})")
        t = targets[s:s + step, None].to(lq.device)
        out["logprob"][s:s + step] = lq.gather(-1, t).squeeze(-1).cpu()
        out["ref_logprob"][s:s + step] = lp.gather(-1, t).squeeze(-1).cpu()
        out["argmax"][s:s + step] = top_q.cpu()
        out["ref_argmax"][s:s + step] = top_p.cpu()
        out["kld"][s:s + step] = kl_rows(lp, lq).cpu()
        del lq, lp
    return out
