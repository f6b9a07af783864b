"""lm-eval adapter: local task files (offline) and the hand-off of an in-memory model."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml

from helpers.models import tiny_llama
from helpers.eval_fixtures import byte_tokenizer
from lowbit.eval import LastWordExample, lastword_accuracy, run_lm_eval, write_lastword_task
from lowbit.eval.harness import LmEvalMissing

EXAMPLES = [LastWordExample("the alphabet goes xyz", "abc"), LastWordExample("and so she said to him", "yes"),
            LastWordExample("it was a fine day for a", "walk")]


def test_write_lastword_task_is_local_json(tmp_path):
    folder = write_lastword_task(tmp_path / "tasks", EXAMPLES)
    cfg = yaml.safe_load((folder / "lowbit_lastword.yaml").read_text())
    assert cfg["task"] == "lowbit_lastword" and cfg["dataset_path"] == "json"
    data = cfg["dataset_kwargs"]["data_files"]["test"]
    assert data == str((folder / "lowbit_lastword.jsonl").resolve())
    rows = [json.loads(line) for line in open(data)]
    assert rows == [e.to_dict() for e in EXAMPLES]
    assert cfg["output_type"] == "loglikelihood"


def test_missing_lm_eval_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(LmEvalMissing, match="pip install"):
        run_lm_eval(tiny_llama(), byte_tokenizer(), ["lowbit_lastword"])


@pytest.mark.slow  # importing lm-eval alone costs ~10 CPU-seconds
def test_lm_eval_runs_offline_and_agrees_with_lowbit(tmp_path):
    pytest.importorskip("lm_eval")
    model, tok = tiny_llama(), byte_tokenizer()
    folder = write_lastword_task(tmp_path / "tasks", EXAMPLES)
    res = run_lm_eval(model, tok, ["lowbit_lastword"], include_path=folder)["lowbit_lastword"]
    ours = lastword_accuracy(model, tok, EXAMPLES, progress=False)
    # lm-eval's acc for loglikelihood tasks is is_greedy; its perplexity is exp(-mean loglik)
    assert res["acc,none"] == pytest.approx(ours.accuracy)
    assert math.log(res["perplexity,none"]) == pytest.approx(-ours.mean_logprob, rel=1e-4)
