"""Exception types raised by lowbit.

Every error names what it is about (a file, a tensor, an option) so that a user can act on it.
"""


from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptionRef:
    """An option named in an error message, spelled as the Python API (``format='lowbit'``) or as
    the CLI (``--format lowbit``) spells it. The CLI flag is ``--`` + the keyword (or ``flag``,
    where the CLI names it otherwise: ``num_samples`` is ``--calib-samples``) with ``_`` as ``-``; a
    True value is the bare flag."""

    name: str
    value: object = True
    flag: str | None = None

    def python(self) -> str:
        return f"{self.name}={self.value!r}"

    def cli(self) -> str:
        flag = "--" + (self.flag or self.name).replace("_", "-")
        return flag if self.value is True else f"{flag} {self.value}"


class LowbitError(Exception):
    """Base class of every error lowbit raises on purpose.

    A message may name options as ``{key}`` fields given as ``OptionRef`` keywords:
    ``FormatError("... (pass {overwrite} to replace it)", overwrite=OptionRef("overwrite"))``.
    ``str(error)`` spells them for Python, ``cli_message()`` as command-line flags."""

    def __init__(self, *args, **options: OptionRef) -> None:
        self.template = args[0] if options and args else None
        self.options = options
        if self.template is not None:
            args = (self._spell(OptionRef.python), *args[1:])
        super().__init__(*args)

    def _spell(self, how) -> str:
        text = self.template
        for key, ref in self.options.items():  # only the named fields: other braces stay as they are
            text = text.replace("{" + key + "}", how(ref))
        return text

    def cli_message(self) -> str:
        """The message with options spelled as the CLI's flags."""
        return str(self) if self.template is None else self._spell(OptionRef.cli)


class QuantizationError(LowbitError, ValueError):
    """A tensor cannot be quantized as asked (NaN/Inf, bad shape for the block size...)."""


class SchemeError(LowbitError, ValueError):
    """A scheme or quantization spec is unknown or inconsistent."""


class FormatError(LowbitError, ValueError):
    """A checkpoint on disk is malformed or does not match its declared scheme."""


class OutputError(LowbitError, OSError):
    """An output folder cannot be written: it is the source, another run holds its lock, or the
    system refused a write (read-only, disk full); the message names the path."""
