"""Reading calibration sources into samples (texts and conversations), offline.

A source (``CalibrationSource.data``) is one of
- ``"builtin"``: lowbit's calibration text (one paragraph a line);
- a list/tuple of strings: texts as given;
- a ``datasets.Dataset`` (or a ``DatasetDict``: its ``split``);
- a path: a file read by its suffix (``SourceKind.of_path``): ``.txt``/``.text``/``.md`` or no
  suffix: a text file, one paragraph a line; ``.jsonl``: one JSON object a line; ``.csv``: a table
  with a header row; ``.parquet``: a table (pyarrow); a folder written by ``datasets``'
  ``save_to_disk``;
- a name that is no local path: a ``datasets`` dataset found in the local cache only (never
  downloaded).
Records (JSONL objects, table and dataset rows) give a text or a conversation from one field
(``lowbit.calibration.records``). ``pyarrow`` and ``datasets`` are imported only for the sources
that need them. Every problem is one CalibrationError naming the file (and line, row or column).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Sequence

from lowbit.calibration.records import CalibrationError, Sample, default_field, sample_of
from lowbit.textfiles import builtin_calibration_text_path, read_paragraphs

BUILTIN = "builtin"


class SourceKind(str, Enum):
    BUILTIN = "builtin"
    STRINGS = "strings"
    TEXT = "text file"
    JSONL = "jsonl"
    CSV = "csv"
    PARQUET = "parquet"
    DATASET_FOLDER = "datasets folder"
    DATASET = "datasets.Dataset"
    CACHED_DATASET = "cached dataset"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of_path(cls, path: Path) -> "SourceKind":
        """The kind of an existing path (a folder must be a ``save_to_disk`` folder), by suffix."""
        if path.is_dir():
            if any((path / f).is_file() for f in _DATASET_FOLDER_FILES):
                return cls.DATASET_FOLDER
            raise CalibrationError(f"calibration folder {str(path)!r} is not a folder saved by datasets' "
                                   f"save_to_disk (no {' or '.join(_DATASET_FOLDER_FILES)})")
        kind = _SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise CalibrationError(f"calibration file {str(path)!r}: lowbit does not read {path.suffix!r} files "
                                   f"(it reads {', '.join(s for s in _SUFFIXES if s)} files, text files without a "
                                   f"suffix and datasets' save_to_disk folders)")
        return kind


_SUFFIXES = {"": SourceKind.TEXT, ".txt": SourceKind.TEXT, ".text": SourceKind.TEXT, ".md": SourceKind.TEXT,
             ".jsonl": SourceKind.JSONL, ".csv": SourceKind.CSV, ".parquet": SourceKind.PARQUET}
_DATASET_FOLDER_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")
_NEEDS_EXTRA = "pip install 'lowbit[{extra}]'"


@dataclass(frozen=True)
class CalibrationSource:
    """One calibration source and its share of a mixture.

    data: what to read (see the module docstring).
    weight: its share of the calibration windows, relative to the other sources' weights (> 0).
    column: the field holding the text or the messages (default: ``text``, else ``messages``).
    split: a DatasetDict's (or cached dataset's) split (default: its only split, else ``train``).
    """

    data: object
    weight: float = 1.0
    column: str | None = None
    split: str | None = None

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == float("inf"):
            raise CalibrationError(f"a calibration source's weight must be a positive number, got {w!r}")


@dataclass(frozen=True)
class Samples:
    """What one source gave: a description for the report, its kind and its samples in order."""

    name: str
    kind: SourceKind
    items: tuple[Sample, ...]


def _head(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


def read_source(src: CalibrationSource) -> Samples:
    """The samples of ``src`` (at least one, else a CalibrationError naming the source)."""
    data = src.data
    if isinstance(data, str) and data == BUILTIN:
        path = builtin_calibration_text_path()
        return _nonempty(BUILTIN, SourceKind.BUILTIN, read_paragraphs(path, kind="calibration", error=CalibrationError))
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        try:
            found = path.exists()
        except OSError:  # not a path at all (e.g. a whole text: too long for a file name)
            raise CalibrationError(f"calibration {_head(str(data))!r} is not a file path (give text as a list of "
                                   f"strings: [text])") from None
        if found:
            return read_path(path, src.column, src.split)
        if isinstance(data, str) and path.suffix == "" and _looks_like_name(data):
            ds = _split_of(_cached_dataset(data, src.split), src.split, data)
            return _dataset_samples(str(data), SourceKind.CACHED_DATASET, ds, src.column)
        raise CalibrationError(f"calibration file {str(path)!r} not found: it does not exist")
    if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray)) \
            and all(isinstance(s, str) for s in data):
        return _nonempty("strings", SourceKind.STRINGS, [s for s in data if s.strip()],
                         what="calibration strings are all empty")
    if _is_dataset(data):
        return _dataset_samples(type(data).__name__, SourceKind.DATASET, _split_of(data, src.split, "the dataset"),
                                src.column)
    raise CalibrationError(
        f"calibration must be a LongTensor [n, seq_len], a list of strings, a file or folder path, a datasets "
        f"dataset, {BUILTIN!r} or CalibrationSource(s); got {type(data).__name__}")


def read_path(path: Path, column: str | None, split: str | None = None) -> Samples:
    kind = SourceKind.of_path(path)
    name = str(path)
    if kind is SourceKind.TEXT:
        return _nonempty(name, kind, read_paragraphs(path, kind="calibration", error=CalibrationError))
    if kind is SourceKind.JSONL:
        return _nonempty(name, kind, read_jsonl(path, column))
    if kind is SourceKind.CSV:
        return _nonempty(name, kind, read_csv(path, column))
    if kind is SourceKind.PARQUET:
        return _nonempty(name, kind, read_parquet(path, column))
    datasets = _import("datasets", name)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any failure of the reader is the folder's problem
        raise CalibrationError(f"calibration folder {name!r} cannot be read by datasets.load_from_disk: "
                               f"{_one_line(e)}") from None
    return _dataset_samples(name, kind, _split_of(ds, split, name), column)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"calibration file {str(path)!r} is not UTF-8 text: {e}") from None


def read_jsonl(path: Path, column: str | None) -> list[Sample]:
    """One sample per non-blank line of a JSON Lines file; a line that is not JSON is an error
    naming ``file:line:column``."""
    out: list[Sample] = []
    field = None
    for n, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{where}:{e.colno}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise CalibrationError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
        if field is None:
            field = column if column is not None else _record_field(record, where)
        s = sample_of(record, field, where)
        if s is not None:
            out.append(s)
    return out


def _record_field(record: dict, where: str) -> str:
    return default_field(list(record), None, where)


def read_csv(path: Path, column: str | None) -> list[Sample]:
    """One text per row of a CSV file with a header row (cells are strings: texts)."""
    text = _text(path)
    reader = csv.DictReader(text.splitlines())
    try:
        fields = reader.fieldnames or []
    except csv.Error as e:
        raise CalibrationError(f"{path}:1: not CSV ({e})") from None
    field = default_field(fields, column, str(path))
    out: list[Sample] = []
    try:
        for row in reader:
            s = sample_of(row, field, f"{path}:{reader.line_num}")
            if s is not None:
                out.append(s)
    except csv.Error as e:
        raise CalibrationError(f"{path}:{reader.line_num}: not CSV ({e})") from None
    return out


def read_parquet(path: Path, column: str | None) -> list[Sample]:
    """One sample per row of a Parquet file's column (strings: texts; lists of {role, content}
    structs: conversations)."""
    pq = _import("pyarrow.parquet", str(path), extra="parquet")
    try:
        names = pq.read_schema(str(path)).names
    except Exception as e:  # noqa: BLE001
        raise CalibrationError(f"calibration file {str(path)!r} is not a Parquet file: {_one_line(e)}") from None
    field = default_field(names, column, str(path))
    values = pq.read_table(str(path), columns=[field]).column(field).to_pylist()
    return _rows(({field: v} for v in values), field, f"{path} row")


def _rows(records: Iterable, field: str, where: str) -> list[Sample]:
    out: list[Sample] = []
    for i, record in enumerate(records):
        s = sample_of(record, field, f"{where} {i}")
        if s is not None:
            out.append(s)
    return out


def _nonempty(name: str, kind: SourceKind, items: list[Sample], what: str | None = None) -> Samples:
    if not items:
        raise CalibrationError(what or f"calibration source {name!r} has no samples (no text or conversation)")
    return Samples(name, kind, tuple(items))


# ---------------------------------------------------------------------------- datasets
def _import(module: str, name: str, extra: str = "datasets"):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise CalibrationError(f"calibration source {name!r} needs the {module.split('.')[0]!r} package: "
                               f"{_NEEDS_EXTRA.format(extra=extra)}") from None


def _is_dataset(data) -> bool:
    mod = type(data).__module__ or ""
    if not mod.startswith("datasets"):  # never import datasets just to ask
        return False
    import datasets

    return isinstance(data, (datasets.Dataset, datasets.DatasetDict))


def _split_of(ds, split: str | None, name: str):
    import datasets

    if not isinstance(ds, datasets.DatasetDict):
        if split is not None and ds.split is not None and str(ds.split) != split:
            raise CalibrationError(f"{name}: it is split {str(ds.split)!r}, not {split!r}")
        return ds
    splits = list(ds)
    if split is None:
        split = splits[0] if len(splits) == 1 else ("train" if "train" in splits else None)
    if split not in ds:
        raise CalibrationError(f"{name}: pick a split with --calib-split / split= ({', '.join(splits)})")
    return ds[split]


def _dataset_samples(name: str, kind: SourceKind, ds, column: str | None) -> Samples:
    if len(ds) == 0:
        raise CalibrationError(f"calibration source {name!r} has no rows (an empty dataset)")
    field = default_field(list(ds.column_names), column, name)
    return _nonempty(name, kind, _rows(ds.select_columns([field]), field, f"{name} row"))


def _looks_like_name(data: str) -> bool:
    """A hub dataset name: ``name`` or ``owner/name`` (no other path separators)."""
    parts = data.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and os.sep not in data.replace("/", "")


def _cached_dataset(name: str, split: str | None):
    """The dataset ``name`` from the local ``datasets`` cache; never from the network (datasets'
    and the hub's offline modes are on for the call, and put back after it)."""
    try:
        import datasets
    except ImportError:
        raise CalibrationError(f"calibration source {name!r} is no local file or folder; as a dataset name it "
                               f"needs the 'datasets' package: {_NEEDS_EXTRA.format(extra='datasets')}") from None
    flags = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    env = {k: os.environ.get(k) for k in flags}
    conf = {k: getattr(datasets.config, k) for k in flags if hasattr(datasets.config, k)}
    try:
        for k in flags:
            os.environ[k] = "1"
        for k in conf:
            setattr(datasets.config, k, True)
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - whatever the loader raises offline: not cached
        raise CalibrationError(f"calibration source {name!r} is no local file or folder, and no dataset of that name "
                               f"is in the local datasets cache (lowbit never downloads): {_one_line(e)}") from None
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in conf.items():
            setattr(datasets.config, k, v)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)
