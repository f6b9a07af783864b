"""Quantize every decoder-only family transformers registers, tiny, and write the table of what happened.

    python bench/families/sweep_families.py [--schemes w8a8-int8,nvfp4,w4a16,w8a8-fp8] [--types a,b]

Each family is built by ``tests/helpers/families.py`` (hidden 128, 2 layers, 4 experts, seed 0),
quantized with lowbit's defaults on 4 x 32 random token windows, saved in the lowbit and the
compressed-tensors formats and reloaded by lowbit; the row says what was quantized, what stayed
in float and why, how many linear groups SmoothQuant folded into (w8a8-int8) and whether both
reloads give the quantized model's logits bit for bit. The table replaces the part of
``docs/families.md`` between its ``sweep`` markers; a family that takes longer than ``--timeout``
seconds for a scheme is marked so.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import lowbit  # noqa: E402
from helpers.families import decoder_only_types, tiny_model  # noqa: E402

START, END = "<!-- sweep:start -->", "<!-- sweep:end -->"


class _Late(Exception):
    pass


def _alarm(_sig, _frm):
    raise _Late


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                return f"{name}, {'AVX-512' if 'avx512f' in flags else 'AVX2'}"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cell(model_type: str, scheme: str, base, ids, ref) -> str:
    q = lowbit.quantize(copy.deepcopy(base), scheme, calibration=ids, batch_size=2, num_samples=4, seq_len=32)
    with torch.no_grad():
        got = q(input_ids=ids, use_cache=False).logits
    err = float((got - ref).norm() / ref.norm())
    n = sum(hasattr(m, "weight_codes") for m in q.modules())
    exact = []
    with tempfile.TemporaryDirectory() as d:
        for fmt, short in (("lowbit", "lb"), ("compressed-tensors", "ct")):
            try:
                back = lowbit.load(lowbit.save(q, Path(d) / fmt, format=fmt))
                with torch.no_grad():
                    same = torch.equal(back(input_ids=ids, use_cache=False).logits, got)
                exact.append(f"{short} {'=' if same else '≠'}")
            except Exception as e:  # noqa: BLE001 - the format's refusal is the finding
                exact.append(f"{short} ✗ ({type(e).__name__})")
    cal = getattr(q, "lowbit_calibration", None)
    smooth = ""
    if cal is not None and cal.smoothquant is not None:
        smooth = f", SQ {sum(1 for g in cal.groups.values() if g.alpha is not None)}"
    return f"{n} lin, err {err:.3f}{smooth}, {' '.join(exact)}"


def _row(t: str, schemes: list[str], timeout: int) -> str:
    """The table row of family ``t`` (run in a process of its own by ``main``)."""
    signal.signal(signal.SIGALRM, _alarm)
    rows: list[str] = []
    for t in [t]:
        ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        try:
            base = tiny_model(t)
            with torch.no_grad():
                ref = base(input_ids=ids, use_cache=False).logits
        except Exception as e:  # noqa: BLE001
            return f"| {t} | transformers cannot build or run it tiny: `{type(e).__name__}` |" + " |" * len(schemes)
        float_kinds = ""
        cells = []
        for s in schemes:
            signal.alarm(timeout)
            try:
                cells.append(_cell(t, s, base, ids, ref))
            except _Late:
                cells.append(f"over {timeout} s")
            except Exception as e:  # noqa: BLE001 - the refusal or crash is the finding
                msg = re.sub(r"[|`\n]", " ", str(e))[:90]
                cells.append(f"✗ `{type(e).__name__}`: {msg}")
            finally:
                signal.alarm(0)
        try:
            from lowbit.linearize import linearize
            from lowbit.targets import float_weights, survey_weights

            m = copy.deepcopy(base)
            linearize(m)
            kinds: dict[str, int] = {}
            for k in float_weights(survey_weights(m)).values():
                kinds[k] = kinds.get(k, 0) + 1
            float_kinds = ", ".join(f"{k} x{v}" for k, v in kinds.items())
        except Exception:  # noqa: BLE001
            float_kinds = "?"
        rows.append(f"| {t} | " + " | ".join(cells) + f" | {float_kinds} |")
    return rows[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="w8a8-int8,nvfp4,w4a16,w8a8-fp8")
    ap.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per family and scheme")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "families.md"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the row of one family, printed
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    schemes = args.schemes.split(",")
    if args.one:
        print("ROW " + _row(args.one, schemes, args.timeout), flush=True)
        return
    types = args.types.split(",") if args.types else decoder_only_types()
    rows, t0 = [], time.time()
    for t in types:  # a process per family: memory freed, a crash or a hang is that family's row
        cmd = [sys.executable, __file__, "--one", t, "--schemes", args.schemes, "--timeout", str(args.timeout)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * (len(schemes) + 1))
            got = [line[4:] for line in p.stdout.splitlines() if line.startswith("ROW ")]
            rows.append(got[0] if got else f"| {t} | the process ended with code {p.returncode} |"
                        + " |" * len(schemes))
        except subprocess.TimeoutExpired:
            rows.append(f"| {t} | over {args.timeout * (len(schemes) + 1)} s |" + " |" * len(schemes))
        print(rows[-1], flush=True)
    head = ("| family | " + " | ".join(schemes) + " | kept in float (not targets) |\n"
            "|---|" + "---|" * len(schemes) + "---|")
    load = open("/proc/loadavg").read().split()[0] if Path("/proc/loadavg").exists() else "?"
    stamp = (f"Generated by `bench/families/sweep_families.py` on "
             f"{datetime.date.today().isoformat()}, transformers {__import__('transformers').__version__}, "
             f"torch {torch.__version__}, {_cpu()}, load {load}, {time.time() - t0:.0f} s. Cell: quantized "
             f"linears, relative logit error against float (random weights), linear groups SmoothQuant folded "
             f"into (SQ), and whether the lowbit (lb) and compressed-tensors (ct) reloads give the same logits "
             f"(=) or not (≠), or a refusal (✗).")
    table = f"{START}\n{stamp}\n\n{head}\n" + "\n".join(rows) + f"\n{END}"
    docs = Path(args.docs)
    text = docs.read_text()
    if START in text and END in text:
        text = text[:text.index(START)] + table + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## The sweep's table\n\n" + table + "\n"
    docs.write_text(text)
    print(f"wrote {docs}")


if __name__ == "__main__":
    main()
