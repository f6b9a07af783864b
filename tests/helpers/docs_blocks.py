"""The code blocks of README.md and docs/*.md, and how tests/docs/test_code_blocks.py runs them.

A block is a fenced ```python, ```bash or ```shell block. Its first line ``# docs-test: skip (why)``
marks it as shown but not run (it needs a GPU, vLLM, several ranks, the network...). Every other
block runs, in page order, in a folder whose ``./model`` is a tiny Llama (``write_docs_model``),
with the calibration budget shrunk (``shrink_calibration``): the two substitutions docs/index.md
documents.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(python|bash|shell)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"^# docs-test: skip \((.+)\)\s*$")

#: the calibration budget the blocks run with (docs/index.md says so)
DOCS_SAMPLES, DOCS_SEQ_LEN = 2, 64


@dataclass(frozen=True)
class Block:
    page: str          # path relative to the repository root
    line: int          # line of the opening fence
    lang: str          # "python" or "bash" ("shell" is bash)
    code: str
    skip: str | None   # the reason it is not run, or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of the docs site, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The code blocks of ``page`` in order."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        code = m.group(2)
        first = code.splitlines()[0] if code.strip() else ""
        skip = SKIP.match(first)
        name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
        out.append(Block(name, text.count("\n", 0, m.start()) + 1,
                         "python" if m.group(1) == "python" else "bash", code, skip.group(1) if skip else None))
    return out


def write_docs_model(path: Path) -> Path:
    """``./model`` of the blocks: a tiny random Llama (2 layers, hidden 128, head size 32, so every
    compressed-tensors layout and the serving emulation take it) with a byte-level tokenizer."""
    from helpers.eval_fixtures import save_tiny_folder

    return save_tiny_folder(path, hidden_size=128, intermediate_size=256, max_position_embeddings=1024)


def shrink_calibration(num_samples: int = DOCS_SAMPLES, seq_len: int = DOCS_SEQ_LEN) -> None:
    """Make ``num_samples`` x ``seq_len`` the calibration budget of this process: the defaults of
    CalibrationConfig's data part (its __init__ and the class attributes ``CalibrationConfig.num_samples``
    and compare read) and the presets' window counts. Options a block passes explicitly still win."""
    from lowbit.calibration import config as data
    from lowbit.calibration.config_parts import DataConfig

    cls = DataConfig
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = list(cls.__init__.__defaults__)
    assert len(defaults) == len(names), "every CalibrationConfig field has a default"
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        defaults[names.index(name)] = value
        setattr(cls, name, value)
    cls.__init__.__defaults__ = tuple(defaults)
    for fields in data.CALIBRATION_PRESETS.values():
        for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
            if name in fields:
                fields[name] = min(fields[name], value)
