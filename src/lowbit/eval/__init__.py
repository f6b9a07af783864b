"""Evaluate a (quantized) model on local text: perplexity, last-word accuracy, lm-eval.

    from lowbit.eval import perplexity, lastword_accuracy
    ppl = perplexity(model, tokenizer, window=512, limit=2048)   # built-in text by default
    acc = lastword_accuracy(model, tokenizer, limit=40)

    ref = float_reference(float_model, tokenizer, limit=2048)           # the float model, scored once
    d = divergence(score_text(quantized, tokenizer, limit=2048, reference=ref))
    d.kld, d.same_top, d.ppl_change_pct                                  # each with its 95% interval

Work is chunked so that full-vocabulary fp32 logits never exist for a whole window.
"""

from lowbit.eval.harness import run_lm_eval, write_lastword_task
from lowbit.eval.lastword import LastWordExample, LastWordResult, lastword_accuracy, lastword_examples
from lowbit.eval.divergence import Divergence, divergence, paired
from lowbit.eval.intervals import Interval
from lowbit.eval.perplexity import PerplexityResult, TextScores, perplexity, score_text, tokenize_with_bytes, window_plan
from lowbit.eval.reference import FloatReference, float_reference
from lowbit.eval.scoring import chunked_logits_apply, hidden_states, output_head, score_positions
from lowbit.eval.text import (EvalDataError, default_calibration_text_path, default_eval_text_path,
                              read_paragraphs, read_text)

__all__ = ["perplexity", "PerplexityResult", "score_text", "TextScores", "float_reference", "FloatReference",
           "divergence", "Divergence", "paired", "Interval", "lastword_accuracy", "lastword_examples", "LastWordExample",
           "LastWordResult", "run_lm_eval", "write_lastword_task", "tokenize_with_bytes", "window_plan",
           "chunked_logits_apply", "hidden_states", "output_head", "score_positions", "EvalDataError",
           "default_eval_text_path", "default_calibration_text_path", "read_paragraphs", "read_text"]
