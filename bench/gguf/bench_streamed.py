"""A calibrated GGUF file streamed one decoder layer at a time against the whole model in memory
(issue 48): peak resident memory, seconds and the file's bytes, side by side in one run.

    .venv/bin/python bench/gguf/bench_streamed.py --model SMOLLM2_FOLDER --calib calib.txt \\
        [--model GEMMA_FOLDER --tokenizer-from gemma.gguf] [--synthetic 1024:4096:24] --mix Q4_K_M --rounds 2

``--synthetic HIDDEN:INTERMEDIATE:LAYERS`` adds a Llama of random weights (seed 0, float32, SmolLM2's
tokenizer and vocabulary, tied embeddings) built in a temporary folder: a model larger than the
real ones here, to see how each mode's peak grows with the model.

Per model and round, each in a fresh process (its peak RSS from ``wait4``):
- ``streamed``: ``lowbit.quantize_gguf(folder, out, mix, calibration=text)`` (``lowbit.gguf_streamed``);
- ``in memory``: ``lowbit.load_model(folder)``, ``lowbit.quantize(model, mix, text, tokenizer=)``,
  ``lowbit.save(model, out, format="gguf")`` (``lowbit.gguf_calibrate``, the whole float model).
Both with the same windows (16 x 512 by default); the two files' tensors must be byte-identical (sha256
over names, types, shapes and bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STREAMED = """
import sys, torch
from lowbit.calibration import CalibrationConfig
from lowbit.gguf_quantize import quantize_gguf
torch.set_num_threads(2)
folder, out, mix, calib, n, seq, tf = sys.argv[1:8]
quantize_gguf(folder, out, mix, calibration=calib, config=CalibrationConfig(num_samples=int(n), seq_len=int(seq)),
              progress=False, overwrite=True, tokenizer_from=tf or None)
"""

IN_MEMORY = """
import sys, torch, lowbit
from lowbit.calibration import CalibrationConfig
torch.set_num_threads(2)
folder, out, mix, calib, n, seq, tf = sys.argv[1:8]
model, tok = lowbit.load_model(folder)
lowbit.quantize(model, mix, calib, tokenizer=tok, config=CalibrationConfig(num_samples=int(n), seq_len=int(seq)))
lowbit.save(model, out, format="gguf", overwrite=True)
"""


def run(code: str, args: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of ``python -c code args`` in a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    if status != 0:
        raise SystemExit(f"failed ({status}):\n{err[-3000:]}")
    return secs, usage.ru_maxrss * 1024


def tensors_sha(path: Path) -> str:
    """sha256 over every tensor's name, type, shape and bytes (the metadata left out: a tokenizer
    taken from another GGUF file, ``--tokenizer-from``, is the streamed run's only)."""
    import gguf

    h = hashlib.sha256()
    for t in gguf.GGUFReader(path).tensors:
        h.update(f"{t.name}:{t.tensor_type.name}:{list(t.shape)}".encode())
        h.update(t.data.tobytes())
    return h.hexdigest()


def synthetic(spec: str, like: Path, dest: Path) -> Path:
    """A Llama folder of random weights shaped by ``spec`` (HIDDEN:INTERMEDIATE:LAYERS), with the
    tokenizer files of the folder ``like``."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    hidden, inter, layers = (int(v) for v in spec.split(":"))
    base = AutoConfig.from_pretrained(like)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      vocab_size=base.vocab_size, tie_word_embeddings=True, max_position_embeddings=2048,
                      bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(dest)
    for f in like.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, dest / f.name)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True, help="a float HF folder (repeat)")
    ap.add_argument("--synthetic", help="HIDDEN:INTERMEDIATE:LAYERS: add a random Llama (tokenizer of the first --model)")
    ap.add_argument("--tokenizer-from", action="append", default=[], help="per --model: a GGUF file or ''")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only-synthetic", action="store_true", help="the --model folders give the tokenizer only")
    ap.add_argument("--modes", default="streamed,in memory", help="which to run, comma-separated")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [] if a.only_synthetic else list(a.model)
        if a.synthetic:
            models.append(str(synthetic(a.synthetic, Path(a.model[0]), Path(tmp) / f"llama-{a.synthetic.replace(':', 'x')}")))
        for k, model in enumerate(models):
            tf = a.tokenizer_from[k] if k < len(a.tokenizer_from) and not a.only_synthetic else ""
            for rnd in range(a.rounds):
                files = {}
                modes = [m.strip() for m in a.modes.split(",")]
                for mode, code in [(m, c) for m, c in (("streamed", STREAMED), ("in memory", IN_MEMORY)) if m in modes]:
                    out = Path(tmp) / f"{k}-{mode.replace(' ', '_')}.gguf"
                    secs, rss = run(code, [model, str(out), a.mix, a.calib, str(a.num_samples), str(a.seq_len), tf])
                    files[mode] = tensors_sha(out)
                    row = {"model": Path(model).name, "round": rnd, "mode": mode, "seconds": round(secs, 1),
                           "peak_rss_mb": round(rss / 2**20), "size": out.stat().st_size,
                           "load": round(os.getloadavg()[0], 2)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if len(files) == 2:
                    same = files["streamed"] == files["in memory"]
                    print(f"{Path(model).name} round {rnd}: files {'identical' if same else 'DIFFER'}", flush=True)
                    rows.append({"model": Path(model).name, "round": rnd, "identical": same})
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
