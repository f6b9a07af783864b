"""The ``lowbit`` command line."""

from lowbit.cli.app import app, main

__all__ = ["app", "main"]
