"""llama.cpp's logits for a GGUF file (its C API through llama-cpp-python, one thread), in this
process (``logits``) or in a child process (``logits_in_child``), where an abort inside llama.cpp
(a ``GGML_ASSERT`` on a model it cannot build) ends the child and comes back as llama.cpp's last
error line instead of ending the test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def logits(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of ``ids``, float64 [len(ids), vocab]. Weight
    repacking into extra buffer types is off: its AMX kernels crash on hosts that do not grant AMX
    state (measured here: a segmentation fault in ``ggml_backend_amx_mul_mat``)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    try:
        if not ctx:
            raise RuntimeError(f"llama.cpp cannot make a context for {path}")
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama.cpp cannot decode with {path}")
        n = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n,))
                         for i in range(len(ids))], dtype=np.float64)
    finally:
        llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||: how far logits ``a`` are from the reference ``b``."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def logits_in_child(path: Path, ids: list[int]) -> np.ndarray | str:
    """``logits`` computed in a child Python; on failure (an error or an abort), the child's first
    line that names an error (llama.cpp's cause), else its last line."""
    out = Path(path).with_suffix(".logits.npy")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    run = subprocess.run([sys.executable, "-m", "helpers.llama_cpp_logits", str(path), str(out),
                          *map(str, ids)], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode == 0:
        return np.load(out)
    lines = [ln for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "GGML_ASSERT" in ln]
    return (errors[0] if errors else lines[-1] if lines else f"exit status {run.returncode}").strip()


if __name__ == "__main__":
    np.save(sys.argv[2], logits(sys.argv[1], [int(t) for t in sys.argv[3:]]))
