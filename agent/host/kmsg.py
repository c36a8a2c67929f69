"""Read the kernel log as /dev/kmsg records, from the device or from a plain file that is appended to.

/dev/kmsg hands out one record per read(): `<level>,<seq>,<usec>,<flag>[,...];<text>` followed by dictionary
("continuation") lines that start with a space. The first read after open returns the oldest buffered record,
so every agent restart would replay the whole boot's history; `KmsgCursor` (boot id + last sequence number,
kept in the state dir by the caller) lets a restart skip what it already acted on. A read that fails with
EPIPE means the kernel overwrote records we had not read yet: we log it, count the gap, and carry on.

A plain file (`--kmsg FILE`, for simulation and demos) holds the same record lines; lines without a header
(`NVRM: Xid ...`, or dmesg's `[  12.345] NVRM: ...`) are accepted too. For a file the cursor also keeps the
inode and byte offset, so headerless lines are not replayed either. Record parsing never raises.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger(__name__)

READ_SIZE = 16384  # larger than the kernel's biggest record (CONSOLE_EXT_LOG_MAX = 8192)
_HEADER = re.compile(r"^(\d{1,10}),(\d{1,20}),(\d{1,20}),([^,;]*)(?:,[^;]*)?;(.*)$", re.DOTALL)
_DMESG_PREFIX = re.compile(r"^(?:<\d{1,4}>)?\s*(?:\[\s*\d+(?:\.\d+)?\]\s?)?")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel-log message. `seq` is None for headerless lines of a plain file."""

    message: str
    seq: int | None = None
    level: int = 6
    timestamp_us: int | None = None
    flag: str = "-"  # "c" (or the obsolete "+") marks a fragment of a continued line
    fields: dict[str, str] = field(default_factory=dict)  # dictionary lines, e.g. DEVICE=+pci:0000:3b:00.0


@dataclass(frozen=True)
class KmsgCursor:
    """Where reading stopped: the boot it belongs to, the last sequence number, and for files the position."""

    boot_id: str = ""
    seq: int | None = None
    inode: int | None = None
    offset: int | None = None


def unescape(text: str) -> str:
    r"""Undo the kernel's `\xNN` escaping of non-printable bytes and backslashes."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text) if "\\x" in text else text


def parse_record(text: str) -> KmsgRecord | None:
    """One record (header line plus optional dictionary lines); a headerless line is a bare message."""
    lines = text.rstrip("\n").split("\n")
    head, extra = lines[0], [line for line in lines[1:] if line.startswith(" ")]
    if not head.strip():
        return None
    fields: dict[str, str] = {}
    for line in extra:
        key, sep, value = line.strip().partition("=")
        if sep:
            fields[key] = unescape(value)
    match = _HEADER.match(head)
    if match is None:
        return KmsgRecord(unescape(_DMESG_PREFIX.sub("", head, count=1)), fields=fields)
    prefix, seq, usec, flag, message = match.groups()
    return KmsgRecord(unescape(message), int(seq), int(prefix) & 7, int(usec), flag.strip() or "-", fields)


def read_boot_id(path: str | Path = "/proc/sys/kernel/random/boot_id") -> str:
    """This boot's id, or "" when it cannot be read."""
    try:
        return Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError as exc:
        log.warning("cannot read boot id from %s (%s); a reboot will not be recognised", path, exc)
        return ""


class _Fragments:
    """Joins `c`/`+` fragments of one continued line; flushed by a normal record or when input pauses."""

    def __init__(self) -> None:
        self._parts: list[KmsgRecord] = []

    def add(self, record: KmsgRecord) -> list[KmsgRecord]:
        if record.flag in ("c", "+"):
            self._parts.append(record)
            return []
        return [*self.flush(), record]

    def flush(self) -> list[KmsgRecord]:
        parts, self._parts = self._parts, []
        if len(parts) <= 1:
            return parts
        merged = {k: v for part in parts for k, v in part.fields.items()}
        return [replace(parts[-1], message="".join(p.message for p in parts), flag="-", fields=merged,
                        timestamp_us=parts[0].timestamp_us)]


class KmsgReader:
    """Non-blocking reader of /dev/kmsg or a plain file; `read_available()` returns what is there now."""

    def __init__(self, path: str | Path, boot_id: str, cursor: KmsgCursor | None = None, *,
                 read: Callable[[int, int], bytes] = os.read, batch_limit: int = 5000) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.lost = 0  # records overwritten before we read them (EPIPE and sequence gaps)
        self._cursor = cursor if cursor is not None and cursor.boot_id == boot_id else None
        self._read = read
        self._batch_limit = batch_limit
        self._fd: int | None = None
        self._device = False
        self._inode: int | None = None
        self._offset = 0
        self._last_seq = self._cursor.seq if self._cursor else None
        self._fragments = _Fragments()

    @property
    def is_device(self) -> bool:
        """True for a character device (pollable); False for a plain file (re-read on an interval)."""
        return self._device

    @property
    def fileno(self) -> int | None:
        """The open descriptor, None before open()."""
        return self._fd

    def open(self) -> None:
        """Open the log; OSError (missing file, no permission) goes to the caller."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        info = os.fstat(fd)
        self._fd, self._device, self._inode = fd, stat.S_ISCHR(info.st_mode), info.st_ino
        self._offset = 0
        cursor = self._cursor
        if not self._device and cursor and cursor.inode == info.st_ino and cursor.offset is not None \
                and cursor.offset <= info.st_size:
            self._offset = cursor.offset
        elif not self._device:
            self._last_seq = None  # another file: its sequence numbers are not the ones we saved

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def cursor(self) -> KmsgCursor:
        """Where to resume after a restart."""
        if self._device:
            return KmsgCursor(self.boot_id, self._last_seq)
        return KmsgCursor(self.boot_id, self._last_seq, self._inode, self._offset)

    def read_available(self) -> tuple[list[KmsgRecord], bool]:
        """New records (fragments merged, already-seen ones skipped), and whether more are waiting."""
        if self._fd is None:
            raise RuntimeError("KmsgReader.open() first")
        raw, more = self._read_device() if self._device else self._read_file()
        records: list[KmsgRecord] = []
        for text in raw:
            record = parse_record(text)
            if record is not None and self._new(record):
                records.extend(self._fragments.add(record))
        if not more:
            records.extend(self._fragments.flush())
        return records, more

    def _new(self, record: KmsgRecord) -> bool:
        if record.seq is None:
            return True
        last = self._last_seq
        if last is not None and record.seq <= last:
            return False
        if last is not None and record.seq > last + 1:
            self.lost += record.seq - last - 1
        self._last_seq = record.seq
        return True

    def _read_device(self) -> tuple[list[str], bool]:
        assert self._fd is not None
        found: list[str] = []
        while len(found) < self._batch_limit:
            try:
                chunk = self._read(self._fd, READ_SIZE)
            except BlockingIOError:
                return found, False
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                log.warning("kernel log records were overwritten before they were read; continuing with the "
                            "oldest one still buffered")
                continue
            if not chunk:
                return found, False
            found.append(chunk.decode("utf-8", errors="replace"))
        return found, True

    def _read_file(self) -> tuple[list[str], bool]:
        assert self._fd is not None
        info = os.stat(self.path)
        if info.st_ino != self._inode or info.st_size < self._offset:
            log.info("kernel log file %s was replaced or truncated; reading it from the start", self.path)
            self.close()
            self._cursor, self._last_seq = None, None
            self.open()
            assert self._fd is not None
        limit = READ_SIZE * 4
        data = os.pread(self._fd, limit, self._offset)
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) == limit:
            cut = limit  # one absurdly long line: take it in pieces rather than stall on it
        self._offset += cut  # an unfinished last line is read again once its newline is there
        return _group_lines(data[:cut].decode("utf-8", errors="replace")), len(data) == limit


def _group_lines(text: str) -> list[str]:
    """Split file text into records: a line starting with a space belongs to the record above it."""
    records: list[str] = []
    for line in text.split("\n"):
        if line.startswith(" "):
            if records:  # else it belongs to a record already handed out: its fields are lost, not its text
                records[-1] += "\n" + line
        elif line:
            records.append(line)
    return records
