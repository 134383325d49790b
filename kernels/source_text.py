"""The only way descriptive text enters generated C or CUDA source.

Kernel source is compiled and loaded into the user's process, so a comment that a value could
close (`*/`, a newline after `//`) would let a shared schedule or records file run code. Comments
are built from validated fields only, and this check refuses anything outside a plain alphabet.
"""
from __future__ import annotations

import re

from maco.core.errors import MacoError
from maco.core.files import short

_PLAIN = re.compile(r"[A-Za-z0-9_ ,.:=+()\[\]-]*")


def comment(text: str) -> str:
    """`/* text */` when text holds only letters, digits, spaces and plain punctuation."""
    if not isinstance(text, str) or not _PLAIN.fullmatch(text):
        raise MacoError(f"refusing to put {short(text)} into generated source")
    return f"/* {text} */"
