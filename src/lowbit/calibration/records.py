"""One calibration sample out of a record (a JSONL object, a table row, a dataset row).

A record gives either a text (a string) or a conversation (a list of {role, content} messages,
as chat datasets such as ultrachat store them). Which field: the one named by ``column``, else
``text`` when the record has it, else ``messages``. Pure functions: no I/O; every error names
``where`` (``file.jsonl:3``, ``dataset row 7``) and is a CalibrationError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from lowbit.errors import LowbitError

TEXT_FIELD = "text"
MESSAGES_FIELD = "messages"


class CalibrationError(LowbitError, ValueError):
    """Calibration data cannot be built as asked."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    """A chat sample: its messages in order, and where it was read (for errors)."""

    messages: tuple[Message, ...]
    where: str

    def as_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


Sample = Union[str, Conversation]


def default_field(fields: Sequence[str], column: str | None, where: str) -> str:
    """The field a source's records are read from: ``column`` when given (it must be one of
    ``fields``), else ``text`` or ``messages``, whichever ``fields`` has (``text`` first)."""
    if column is not None:
        if column not in fields:
            raise CalibrationError(f"{where}: no column {column!r} (columns: {', '.join(fields) or 'none'}); "
                                   f"pass the column holding the text or the messages")
        return column
    for name in (TEXT_FIELD, MESSAGES_FIELD):
        if name in fields:
            return name
    raise CalibrationError(f"{where}: no {TEXT_FIELD!r} or {MESSAGES_FIELD!r} column (columns: "
                           f"{', '.join(fields) or 'none'}); name the one to read with --calib-column / column=")


def sample_of(record: Mapping, field: str, where: str) -> Sample | None:
    """The sample in ``record[field]``: a string is a text (None when blank: skipped), a list of
    {role, content} mappings is a Conversation; anything else, or a missing field, is an error."""
    if not isinstance(record, Mapping):
        raise CalibrationError(f"{where}: a record must be an object with a {field!r} field, "
                               f"got {type(record).__name__}")
    if field not in record:
        raise CalibrationError(f"{where}: no {field!r} field (fields: {', '.join(map(str, record)) or 'none'})")
    value = record[field]
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return conversation_of(value, f"{where}: {field!r}")
    raise CalibrationError(f"{where}: {field!r} must be a string or a list of {{role, content}} messages, "
                           f"got {type(value).__name__}")


def conversation_of(messages: Sequence, where: str) -> Conversation:
    """A Conversation of ``messages`` (each a mapping with string ``role`` and ``content``)."""
    if len(messages) == 0:
        raise CalibrationError(f"{where}: the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise CalibrationError(f"{where}: message {i} must be an object with 'role' and 'content', "
                                   f"got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else type(m[key]).__name__
                raise CalibrationError(f"{where}: message {i} needs a string {key!r} ({got})")
        out.append(Message(m["role"], m["content"]))
    return Conversation(tuple(out), where)
