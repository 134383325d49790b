"""Files users give and keep: read with a size cap and a clear error, written whole or not at all.

Schedules, records, plans and caches are data people share, so a bad one must fail with one line
that names it (never a traceback, never a hang on a huge or deeply nested file), and a file MACO
writes must never be left half-written.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from maco.errors import MacoError

MAX_JSON_BYTES = 64 << 20  # a plan, schedule or predictor file; records are capped per line
MAX_LINE_BYTES = 1 << 20  # one record (a few kB in practice)


def short(value: Any, limit: int = 60) -> str:
    """repr() cut to `limit` characters, for error messages that quote untrusted values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_json(text: str | bytes, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """json.loads with a size cap; too large, malformed or too deeply nested -> MacoError."""
    if len(text) > max_bytes:
        raise MacoError(f"not a {what}: {len(text)} bytes, more than the {max_bytes}-byte limit")
    try:
        return json.loads(text)
    except RecursionError:
        raise MacoError(f"not a {what}: nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MacoError(f"not a {what}: {exc}") from None


def read_text(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """The text of a user's file, or MacoError naming it (missing, a folder, unreadable, too big)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise MacoError(f"{what} {str(p)!r} is a directory, not a file")
        size = p.stat().st_size
        if size > max_bytes:
            raise MacoError(f"{what} {str(p)!r} is {size} bytes, more than the {max_bytes}-byte limit")
        return p.read_text()
    except FileNotFoundError:
        raise MacoError(f"cannot read {what} {str(p)!r}: it does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MacoError(f"cannot read {what} {str(p)!r}: {exc}") from None


def load_json_file(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    return load_json(read_text(path, what, max_bytes), f"{what} {str(path)!r}", max_bytes)


def check_writable(path: str | os.PathLike[str], what: str, folder: bool = False) -> Path:
    """Fail before any work starts when `path` (a file, or a folder if `folder`) cannot be
    written: a run that measures for minutes and then cannot save has lost that time."""
    p = Path(path)
    target = p if folder else p.parent
    if not folder and p.is_dir():
        raise MacoError(f"{what} {str(p)!r} is a directory; give a file path")
    if folder and p.exists() and not p.is_dir():
        raise MacoError(f"{what} {str(p)!r} is a file; give a folder")
    existing = target
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise MacoError(f"cannot write {what} {str(p)!r}: {str(existing)!r} is not a folder")
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".maco-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
        if not folder and p.exists() and not os.access(p, os.W_OK):
            raise PermissionError(f"{p} is read-only")
    except OSError as exc:
        raise MacoError(f"cannot write {what} {str(p)!r}: {exc.strerror or exc}") from None
    return p


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a whole file or nothing: a temp file beside it, fsync, then os.replace."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make results unreadable to others
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
