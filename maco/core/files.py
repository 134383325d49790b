"""Files users give and keep: read with a size cap and a clear error, written whole or not at all.

Schedules, records, plans and caches are data people share, so a bad one must fail with one line
that names it (never a traceback, never a hang on a huge or deeply nested file), and a file MACO
writes must never be left half-written.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from maco.core.errors import MacoError

MAX_JSON_BYTES = 64 << 20  # a plan, schedule or predictor file; records are capped per line
MAX_LINE_BYTES = 1 << 20  # one record (a few kB in practice)
# Deepest [ / { nesting MACO accepts: its own files nest under 10 levels (XGBoost models 6). The
# parsers recurse per level (Python's json into a RecursionError, XGBoost's into a segfault).
MAX_JSON_DEPTH = 100

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def short(value: Any, limit: int = 60) -> str:
    """repr() cut to `limit` characters, for error messages that quote untrusted values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of [ and { outside JSON strings, counted without recursion (for
    malformed text an estimate; the parser refuses it anyway)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def check_depth(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """MacoError when `text` nests [ and { deeper than `max_depth`, before any parser recurses."""
    opens = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    if opens > max_depth and json_depth(text) > max_depth:
        raise MacoError(f"not a {what}: nested too deeply (more than {max_depth} levels)")


def load_json(text: str | bytes, what: str, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads with a size and a nesting cap; too large, malformed, too deeply nested or
    holding an integer Python refuses to convert -> MacoError."""
    if len(text) > max_bytes:
        raise MacoError(f"not a {what}: {len(text)} bytes, more than the {max_bytes}-byte limit")
    check_depth(text, what, max_depth)
    try:
        return json.loads(text)
    except RecursionError:
        raise MacoError(f"not a {what}: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of > 4300 digits
        if "integer string conversion" in str(exc):
            raise MacoError(f"not a {what}: it holds an integer of more than "
                            f"{sys.get_int_max_str_digits()} digits") from None
        raise MacoError(f"not a {what}: {exc}") from None


_KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _check_regular(mode: int, p: Path, what: str) -> None:
    if stat.S_ISDIR(mode):
        raise MacoError(f"{what} {str(p)!r} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise MacoError(f"{what} {str(p)!r} is {_KINDS.get(stat.S_IFMT(mode), 'not a file')}, "
                        "not a regular file")


def read_bytes(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a user's regular file, at most `max_bytes`, or MacoError naming it (missing,
    a folder, a pipe or device, unreadable, too big). Never waits on a FIFO and never reads past
    the cap, whatever size the file claims (a link to /dev/zero claims 0 bytes)."""
    p = Path(path)
    try:
        _check_regular(os.stat(p).st_mode, p, what)  # a device is refused before it is opened
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)  # what was opened, not what the path named a moment before
            _check_regular(st.st_mode, p, what)
            if st.st_size > max_bytes:
                raise MacoError(f"{what} {str(p)!r} is {st.st_size} bytes, more than the {max_bytes}-byte limit")
            chunks, total = [], 0
            while total <= max_bytes:  # at most the cap and one byte, to see a file that grew
                chunk = os.read(fd, min(max_bytes + 1 - total, 1 << 24))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise MacoError(f"cannot read {what} {str(p)!r}: it does not exist") from None
    except OSError as exc:
        raise MacoError(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    if total > max_bytes:
        raise MacoError(f"{what} {str(p)!r} is more than the {max_bytes}-byte limit")
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a user's file, or MacoError naming it (as read_bytes, or not UTF-8)."""
    try:
        return read_bytes(path, what, max_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MacoError(f"cannot read {what} {str(path)!r}: {exc}") from None


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
