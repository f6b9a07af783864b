"""Run the docs' code blocks page by page, in order (tests/docs/test_code_blocks.py).

    python docs_runner.py BLOCKS.json RESULT.json MODEL_DIR

BLOCKS.json: {page: [{"where", "lang", "code"}, ...]}. Each page runs in its own empty folder
holding a copy of MODEL_DIR as ``./model``. Python blocks of a page share one namespace (a page
reads top to bottom); shell blocks run in ``bash -euo pipefail`` with ``lowbit`` on PATH: a client of
helpers.docs_zygote, which runs ``lowbit.cli.main`` in a process forked after the imports, with the
shrunk calibration budget. A page stops at its first failing block. RESULT.json: {page: [{"where",
"ok", "error", "seconds"}, ...]}. One process for every page: torch is imported once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HELPERS = Path(__file__).resolve().parent


def run_block(block: dict, namespace: dict, env: dict) -> dict:
    t0 = time.perf_counter()
    try:
        if block["lang"] == "python":
            exec(compile(block["code"], block["where"], "exec"), namespace)  # noqa: S102 - the docs' own code
            ok, error = True, None
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]], env=env, capture_output=True,
                               text=True)
            ok = r.returncode == 0
            error = None if ok else f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    except BaseException:  # noqa: BLE001 - reported, then the page stops
        ok, error = False, traceback.format_exc()[-4000:]
    return {"where": block["where"], "ok": ok, "error": error, "seconds": round(time.perf_counter() - t0, 1)}


def main(blocks_file: str, result_file: str, model_dir: str) -> int:
    sys.path.insert(0, str(HELPERS.parent))
    from helpers.docs_blocks import shrink_calibration

    from helpers.docs_zygote import start

    shrink_calibration()
    top = Path.cwd()
    server, env = start(top / ".docs-bin")  # `lowbit` in shell blocks: lowbit.cli.main in a forked child
    results: dict[str, list] = {}
    for i, (page, todo) in enumerate(json.loads(Path(blocks_file).read_text()).items()):
        folder = top / f"page-{i}"
        folder.mkdir()
        shutil.copytree(model_dir, folder / "model")
        os.chdir(folder)
        namespace: dict = {"__name__": "__main__"}
        results[page] = []
        for block in todo:
            results[page].append(run_block(block, namespace, env))
            if not results[page][-1]["ok"]:
                break
        os.chdir(top)
    os.kill(server, signal.SIGTERM)
    os.waitpid(server, 0)
    Path(result_file).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
