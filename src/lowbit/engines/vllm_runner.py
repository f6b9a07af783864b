"""vLLM as an evaluation engine, run in a subprocess of vLLM's own Python.

vLLM cannot be imported next to lowbit (it pins older transformers and compressed-tensors), so
it gets a venv of its own (../shared/README.md, "vLLM on the CPU") and lowbit sends it token ids
through ``vllm_worker.py`` (a standalone script) and reads back log-probabilities and greedy
tokens. Which Python: the ``python`` argument (``lowbit eval --vllm-python PATH``), else the first
of ``VLLM_PYTHON_CANDIDATES`` that exists: ``.venv-vllm/bin/python`` in the working directory, then
in each of its parents. Nothing is read from the environment.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lowbit.errors import LowbitError

WORKER = Path(__file__).with_name("vllm_worker.py")  # its folder goes first on sys.path: no module here is named vllm
VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"


class EngineUnavailable(LowbitError):
    """The engine's Python cannot be found or cannot import it."""


class EngineError(LowbitError):
    """The engine ran and refused the folder (its message is the error's)."""


def vllm_python_candidates(start: Path | None = None) -> list[Path]:
    """Where a vLLM venv is looked for: ``.venv-vllm/bin/python`` in ``start`` (default: the
    working directory) and each of its parents, nearest first."""
    start = (start or Path.cwd()).resolve()
    return [d / VENV_PYTHON for d in (start, *start.parents)]


def find_vllm_python(python: str | Path | None = None) -> Path:
    """The Python to run vLLM with: ``python`` when given (it must exist), else the first candidate."""
    if python is not None:
        p = Path(python)
        if not p.is_file():
            raise EngineUnavailable(f"--vllm-python {str(p)!r}: no such file")
        return p
    for p in vllm_python_candidates():
        if p.is_file():
            return p
    raise EngineUnavailable("vLLM is not available: no .venv-vllm/bin/python in the working directory or its "
                            "parents; install it (../shared/README.md) or pass --vllm-python PATH")


@dataclass(frozen=True)
class EngineReply:
    logprobs: list[list[float]]   # per scored prompt: log p(ids[t] | ids[:t]) for t >= 1
    greedy: list[list[bool]]      # per scored prompt: ids[t] is the argmax at t, for t >= 1
    generated: list[list[int]]    # per generation prompt: greedy token ids
    load_s: float
    run_s: float


def run_vllm(folder: str | Path, *, score: list[list[int]] = (), generate: list[list[int]] = (),
             max_tokens: int = 16, dtype: str = "bfloat16", python: str | Path | None = None,
             timeout_s: float = 1800.0) -> EngineReply:
    """Serve ``folder`` with vLLM (one process, eager, ``dtype``) and score / greedily continue the
    given token-id prompts. EngineUnavailable when vLLM cannot be run, EngineError when it refuses
    the folder or fails, with vLLM's message in one line."""
    py = find_vllm_python(python)
    longest = max([len(p) for p in score] + [len(p) + max_tokens for p in generate] + [2])
    req = {"folder": str(Path(folder).resolve()), "dtype": dtype, "max_model_len": longest + 8,
           "score": [list(map(int, p)) for p in score], "generate": [list(map(int, p)) for p in generate],
           "max_tokens": int(max_tokens)}
    try:
        proc = subprocess.run([str(py), str(WORKER)], input=json.dumps(req), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineError(f"vLLM ({py}) gave no answer for {str(folder)!r} within {timeout_s:.0f} s") from None
    except OSError as e:
        raise EngineUnavailable(f"--vllm-python {str(py)!r} cannot be run: {e}") from None
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise EngineError(f"vLLM ({py}) exited with status {proc.returncode} on {str(folder)!r}: {tail}")
    out = json.loads(lines[-1])
    if "error" in out:
        cls = EngineUnavailable if out["error"].startswith("cannot import vllm") else EngineError
        raise cls(f"{out['error']} (folder {str(folder)!r})")
    return EngineReply(out["logprobs"], out["greedy"], out["generated"], out["load_s"], out["run_s"])
