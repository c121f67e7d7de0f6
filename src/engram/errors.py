"""`EngramError`: the one base class of every error engram raises on purpose.

Each subclass keeps the builtin base it had before 0.3 (most are `ValueError`s), so
`except ValueError` in callers keeps working while `except engram.EngramError` catches them all.
"""

from __future__ import annotations


class EngramError(Exception):
    """Base of every error engram raises for bad input, files or state; the message names the problem and the fix."""


def install_hint(extras: str) -> str:
    """The command that installs optional `extras` ("serve", "hf,gguf"): engram-torch installs from a checkout, not
    from the package index, so the hint is the editable install run in that checkout."""
    return f"pip install -e '.[{extras}]' in engram's checkout"
