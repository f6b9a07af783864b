"""Exception types raised by lowbit.

Every error names what it is about (a file, a tensor, an option) so that a user can act on it.
"""


class LowbitError(Exception):
    """Base class of every error lowbit raises on purpose."""


class QuantizationError(LowbitError, ValueError):
    """A tensor cannot be quantized as asked (NaN/Inf, bad shape for the block size...)."""


class SchemeError(LowbitError, ValueError):
    """A scheme or quantization spec is unknown or inconsistent."""


class FormatError(LowbitError, ValueError):
    """A checkpoint on disk is malformed or does not match its declared scheme."""


class OutputError(LowbitError, OSError):
    """An output folder cannot be written: it is the source, another run holds its lock, or the
    system refused a write (read-only, disk full); the message names the path."""
