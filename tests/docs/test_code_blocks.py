"""Every ```python and ```bash block of README.md and docs/*.md runs, page by page, against a tiny model.

The substitutions (docs/index.md, "How the examples on these pages are run"): ``./model`` is a tiny
Llama the test writes into an empty folder per page, and the calibration budget is 2 x 64 tokens
unless a block sets one. A block whose first line is ``# docs-test: skip (why)`` is not run. So
that the test cannot pass by running nothing, every page must have run all its runnable blocks,
and the docs as a whole must have at least MIN_RUN of them. All pages run in one process (one
torch import), started once per test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.docs_blocks import ROOT, blocks, pages, write_docs_model

RUNNER = ROOT / "tests" / "helpers" / "docs_runner.py"
MIN_RUN = 30  # runnable blocks today: raise it when adding blocks, never lower it to pass
PAGES = [p.relative_to(ROOT).as_posix() for p in pages()]


def _runnable(page: str):
    return [b for b in blocks(ROOT / page) if b.skip is None]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, list[dict]]:
    """page -> the runner's result of each block it ran."""
    import lowbit

    work = tmp_path_factory.mktemp("docs-blocks")
    write_docs_model(work / "template")
    todo = {p: [{"where": b.where, "lang": b.lang, "code": b.code} for b in _runnable(p)] for p in PAGES}
    (work / "blocks.json").write_text(json.dumps(todo))
    # this tree's lowbit and the helpers for the runner and every `lowbit` it starts, whatever the cwd
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(lowbit.__file__).resolve().parents[1]),
                                                       str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(RUNNER), "blocks.json", "result.json", str(work / "template")],
                       cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((work / "result.json").read_text())


def test_the_docs_have_runnable_blocks_and_every_skip_says_why():
    every = [b for p in PAGES for b in blocks(ROOT / p)]
    assert sum(b.skip is None for b in every) >= MIN_RUN
    assert all(b.skip.strip() for b in every if b.skip is not None)


def test_extraction_sees_fences_and_skip_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n```python\nx = 1\n```\n\n```bash\n# docs-test: skip (needs a GPU)\nnvidia-smi\n```\n"
                    "```text\nnot code\n```\n```shell\necho hi\n```\n")
    got = [(b.lang, b.line, b.skip) for b in blocks(page)]
    assert got == [("python", 2, None), ("bash", 6, "needs a GPU"), ("bash", 13, None)]


@pytest.mark.subprocess
@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page, ran):
    results = ran[page]
    failed = [f"{x['where']}:\n{x['error']}" for x in results if not x["ok"]]
    assert not failed, "\n\n".join(failed)
    assert [x["where"] for x in results] == [b.where for b in _runnable(page)]  # every runnable block ran
    print(" ".join(f"{x['where']} {x['seconds']}s" for x in results))
