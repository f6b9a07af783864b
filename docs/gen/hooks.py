"""mkdocs hook: replace each ``<!-- lowbit:NAME -->`` marker in a page with the Markdown that
``tables.TABLES[NAME]`` builds from lowbit's code (presets, defaults, serving verdicts, CLI), so
those tables are never typed by hand. An unknown marker fails the build."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))  # the docs describe this tree's lowbit, not another install
sys.path.insert(0, str(HERE))
from tables import TABLES  # noqa: E402

MARKER = re.compile(r"<!-- lowbit:([a-z0-9-]+) -->")


def expand(markdown: str, where: str = "page") -> str:
    """``markdown`` with every marker replaced; a ValueError names an unknown one."""
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise ValueError(f"{where}: unknown marker lowbit:{name}; known: {', '.join(sorted(TABLES))}")
        return TABLES[name]()

    return MARKER.sub(sub, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    return expand(markdown, page.file.src_path)
