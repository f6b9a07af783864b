"""The docs' generated tables (docs/gen/tables.py) say what the code says: one row per preset with its
real scale rule and defaults, the measured serving verdicts, every CLI command and option; and no
page names a marker the build cannot fill."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "gen"))

import hooks  # noqa: E402
import tables  # noqa: E402


def _rows(markdown: str) -> dict[str, list[str]]:
    """First cell (backticks stripped) -> the row's cells, for every body row of the tables."""
    out = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            out[cells[0].strip("`")] = cells
    return out


def test_schemes_table_has_every_preset_with_its_scale_rule():
    from lowbit.schemes import PRESETS

    rows = _rows(tables.schemes())
    assert set(rows) - {"scheme"} == set(PRESETS)
    for name, scheme in PRESETS.items():
        assert rows[name][3] == f"`{scheme.weights.observer.value}`", name
        assert rows[name][4] == ("yes" if scheme.needs_calibration else "no"), name


def test_scheme_defaults_follow_the_calibration_rules():
    rows = _rows(tables.scheme_defaults())
    assert rows["w4a16"][1:5] == ["gptq", "on", "20", "quantized"]
    assert rows["w4a16-asym"][1] == "rtn"                      # GPTQ takes no zero points
    assert rows["w8a8-int8"][1] == "rtn" and rows["w8a8-int8"][5] == "0.8"
    assert rows["w8a8-fp8"][5] == "0.5" and rows["nvfp4"][5] == "none"


def test_formats_table_reads_the_measured_verdicts():
    from lowbit.formats.ct_serving import vllm_cpu_verdict
    from lowbit.schemes import PRESETS

    rows = _rows(tables.formats())
    assert set(rows) - {"scheme"} == set(PRESETS)
    assert rows["nvfp4-e5m3"][2].startswith("refused:")
    assert rows["nvfp4"][2] == "`nvfp4-pack-quantized`"
    for name, scheme in PRESETS.items():
        assert rows[name][3].startswith(f"**{vllm_cpu_verdict(scheme).serving}**"), name
        assert rows[name][4] == f"**{vllm_cpu_verdict(scheme, moe=True).serving}**", name


def test_cli_reference_lists_every_command_and_option():
    import typer.main

    from lowbit.cli import app

    text = tables.cli()
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        assert f"## lowbit {name}\n" in text, name
        for p in cmd.params:
            for opt in p.opts if p.param_type_name == "option" else [p.name.upper()]:
                assert f"`{opt}`" in text, (name, opt)
    assert "`--version`" in text


def test_every_marker_in_the_pages_is_known_and_filled():
    pages = sorted((ROOT / "docs").glob("*.md"))
    used = {m for p in pages for m in hooks.MARKER.findall(p.read_text())}
    assert used == set(tables.TABLES)          # every table is shown somewhere, every marker filled
    for p in pages:
        assert "<!-- lowbit:" not in hooks.expand(p.read_text(), p.name)


def test_an_unknown_marker_fails_the_build():
    with pytest.raises(ValueError, match="unknown marker lowbit:nope"):
        hooks.expand("text <!-- lowbit:nope --> text")
