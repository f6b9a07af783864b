"""lm-eval-harness adapter (optional dependency ``lm-eval``), usable offline.

``run_lm_eval`` hands an already-loaded (possibly quantized) model to lm-eval's ``HFLM``
wrapper. Hub datasets cannot be fetched here, so tasks come from local YAML files
(``include_path``) over local json (``dataset_path: json``); ``write_lastword_task`` writes
such a task (lm-eval's LAMBADA recipe over our own last-word examples) into a folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lowbit.errors import LowbitError
from lowbit.files.atomic import write_text_atomic
from lowbit.eval.lastword import LastWordExample, lastword_examples
from lowbit.eval.text import read_paragraphs

LASTWORD_TASK = "lowbit_lastword"

_TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + word}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
metadata:
  version: 1.0
"""


class LmEvalMissing(LowbitError, ImportError):
    """lm-eval is not installed."""


def write_lastword_task(folder: str | os.PathLike, examples: list[LastWordExample] | None = None, *,
                        text_file: str | os.PathLike | None = None, limit: int | None = None,
                        task: str = LASTWORD_TASK) -> Path:
    """Write ``<task>.yaml`` and ``<task>.jsonl`` into ``folder``; returns the folder (an
    lm-eval ``include_path``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if examples is None:
        examples = lastword_examples(read_paragraphs(text_file), limit=limit)
    data = folder / f"{task}.jsonl"
    write_text_atomic(data, "".join(json.dumps(ex.to_dict()) + "\n" for ex in examples))
    write_text_atomic(folder / f"{task}.yaml", _TASK_YAML.format(task=task, data=json.dumps(str(data.resolve()))))
    return folder


def run_lm_eval(model, tokenizer, tasks: list[str], *, include_path: str | os.PathLike | None = None,
                limit: int | None = None, batch_size: int = 1, **kwargs) -> dict:
    """Run lm-eval ``tasks`` on an in-memory model; returns lm-eval's ``results`` mapping."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise LmEvalMissing("the lm-eval adapter needs the optional 'lm-eval' package: "
                            "pip install 'lowbit[lm-eval]'") from e
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local json only: never reach for a hub
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    tm = TaskManager(include_path=None if include_path is None else str(include_path))
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit, **kwargs)
    if out is None:
        raise LowbitError(f"lm-eval returned no results for tasks {tasks}")
    return out["results"]
