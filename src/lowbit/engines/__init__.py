"""Inference engines lowbit can evaluate a folder through, each in a process of its own.

    from lowbit.engines import run_vllm
    reply = run_vllm("out/", score=[ids])      # vLLM's prompt log-probabilities of ids

lowbit.quant.serving holds the arithmetic of those engines' kernels (for lowbit's own emulation of
them); this package runs the engines themselves.
"""

from lowbit.engines.vllm_runner import (EngineError, EngineReply, EngineUnavailable, find_vllm_python, run_vllm,
                                 vllm_python_candidates)

__all__ = ["run_vllm", "find_vllm_python", "vllm_python_candidates", "EngineReply", "EngineError",
           "EngineUnavailable"]
