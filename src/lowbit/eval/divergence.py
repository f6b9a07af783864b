"""What a model owes its float reference, token by token, and what tells two models apart.

Definitions (natural log; N scored tokens of one window plan; P the float model's distribution
at a position, Q the quantized model's; the same as llama.cpp's ``llama-perplexity
--kl-divergence``):

- KL divergence: ``KLD = (1/N) sum_t sum_v P_t(v) (log P_t(v) - log Q_t(v))``, over the whole
  vocabulary (``lowbit.eval.scoring.kl_rows``), with its per-token median, 90th and 99th
  percentiles and maximum;
- same top token: the share of tokens where ``argmax P_t == argmax Q_t``;
- perplexity change: ``Δppl = ppl_Q / ppl_P - 1 = exp((1/N) sum_t (nll_Q,t - nll_P,t)) - 1``;
- RMS Δp: ``sqrt((1/N) sum_t (Q_t(x_t) - P_t(x_t))^2)``, the probability of the token that came.

Every mean carries the batch-means 95% interval of ``lowbit.eval.intervals``; Δppl's is that of
the mean per-token NLL difference (paired: the same tokens), mapped through ``exp(.) - 1``.
``paired`` compares two quantized models the same way; they are *within noise* of each other when
the interval of their per-token KLD difference contains zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lowbit.eval.intervals import DEFAULT_BLOCKS, Interval, mean_interval, percentiles
from lowbit.eval.perplexity import TextScores


def _pct_change(x: float) -> float:
    return 100.0 * math.expm1(x)


@dataclass(frozen=True)
class Divergence:
    """A model against its float reference on the same tokens (see the module docstring)."""

    tokens: int
    blocks: int                  # contiguous blocks of the batch-means intervals
    kld: Interval                # mean KL(float || model) per token, nats
    kld_percentiles: dict        # p50, p90, p99, max of the per-token KLD
    same_top: Interval           # share of tokens with the same top token, in [0, 1]
    ppl_change_pct: Interval     # 100 (ppl / float ppl - 1), paired interval
    rms_delta_p: float           # root mean square of the change in the token's probability
    perplexity: Interval         # the model's perplexity with its interval
    float_perplexity: Interval

    def to_dict(self) -> dict:
        d = {k: (v.to_dict() if isinstance(v, Interval) else v) for k, v in self.__dict__.items()}
        d["kld_percentiles"] = dict(self.kld_percentiles)
        return d


def perplexity_interval(scores: TextScores, blocks: int = DEFAULT_BLOCKS) -> Interval:
    """The perplexity of ``scores`` with the interval of its mean NLL mapped through exp."""
    return mean_interval(scores.nll.numpy(), blocks).map(math.exp)


def divergence(scores: TextScores, blocks: int = DEFAULT_BLOCKS) -> Divergence:
    """The measures of ``scores`` taken against a reference (``score_text(reference=...)``)."""
    if scores.kld is None or scores.ref_logprob is None:
        raise ValueError("these scores were taken without a float reference: no KL divergence")
    kld = scores.kld.numpy()
    same = (scores.argmax == scores.ref_argmax).double().numpy()
    ref_nll = -scores.ref_logprob.double().numpy()
    diff = scores.nll.numpy() - ref_nll
    dp = np.exp(scores.logprob.double().numpy()) - np.exp(scores.ref_logprob.double().numpy())
    return Divergence(tokens=len(kld), blocks=min(blocks, len(kld)), kld=mean_interval(kld, blocks),
                      kld_percentiles=percentiles(kld), same_top=mean_interval(same, blocks),
                      ppl_change_pct=mean_interval(diff, blocks).map(_pct_change),
                      rms_delta_p=float(np.sqrt(np.mean(dp * dp))),
                      perplexity=perplexity_interval(scores, blocks),
                      float_perplexity=mean_interval(ref_nll, blocks).map(math.exp))


def paired(a: TextScores, b: TextScores, blocks: int = DEFAULT_BLOCKS) -> dict:
    """Model ``a`` against model ``b``, both scored against one reference on the same tokens:
    the interval of their mean KLD difference (a - b), of their perplexity ratio as a % change
    (a over b), and ``within_noise``: whether the KLD difference's interval contains zero."""
    if a.kld is None or b.kld is None:
        raise ValueError("paired comparison needs both models scored against the float reference")
    if not np.array_equal(a.targets.numpy(), b.targets.numpy()):
        raise ValueError("the two models were scored on different tokens")
    dk = mean_interval(a.kld.numpy() - b.kld.numpy(), blocks)
    dn = mean_interval(a.nll.numpy() - b.nll.numpy(), blocks).map(_pct_change)
    return {"kld_difference": dk.to_dict(), "ppl_ratio_pct": dn.to_dict(), "within_noise": dk.contains(0.0),
            "ppl_within_noise": dn.contains(0.0)}
