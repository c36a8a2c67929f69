"""Read the kernel log as /dev/kmsg records, from the device or from a plain file that is appended to.

/dev/kmsg hands out one record per read(): `<level>,<seq>,<usec>,<flag>[,...];<text>` followed by dictionary
("continuation") lines that start with a space. The first read after open returns the oldest buffered record,
so every agent restart would replay the whole boot's history; `KmsgCursor` (boot id + last sequence number,
kept in the state dir by the caller) lets a restart skip what it already acted on. A read that fails with
EPIPE means the kernel overwrote records we had not read yet: we log it, count the gap, and carry on.

Every record is its own message. NVIDIA's driver prints each `NVRM:` line with KERN_CONT, so /dev/kmsg flags
each with `c` (NVIDIA/DCGM's own kmsg test reads `4,1227,...,c;NVRM: Xid ...`); joining `c` records would glue
a burst of Xids into one message and lose all but the first. Sequence numbers only ever grow on one kernel: a
record whose number goes back means the one before was not a real kernel number (a hand-written file), and a
saved cursor ahead of everything the kernel still holds belongs to no kernel we can see; either way the reader
resynchronises instead of skipping every later record.

A plain file (`--kmsg FILE`, for simulation and demos) holds the same record lines; lines without a header
(`NVRM: Xid ...`, or dmesg's `[  12.345] NVRM: ...`) are accepted too, and so are dmesg's indented
continuation lines of a multi-line message (they join the message; ` KEY=value` lines stay dictionary
fields). For a file the cursor keeps the inode and byte offset, which is what skips replays there. Record
parsing never raises.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

READ_SIZE = 16384  # larger than the kernel's biggest record (CONSOLE_EXT_LOG_MAX = 8192)
_HEADER = re.compile(r"^(\d{1,10}),(\d{1,20}),(\d{1,20}),([^,;]*)(?:,[^;]*)?;(.*)$", re.DOTALL)
_DMESG_PREFIX = re.compile(r"^(?:<\d{1,4}>)?\s*(?:\[\s*\d+(?:\.\d+)?\]\s?)?")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_DICT_LINE = re.compile(r"^ [A-Z][A-Z0-9_]{0,63}=")  # a /dev/kmsg dictionary line, e.g. " SUBSYSTEM=pci"
KERNEL_FACILITY = 0  # LOG_KERN; user space writing to /dev/kmsg gets LOG_USER (1) or what it asks for
MAX_SEQ_JUMP = 1 << 24  # a forward jump larger than this is not records lost but a number that is not real


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel-log message. `seq` is None for headerless lines of a plain file."""

    message: str
    seq: int | None = None
    level: int = 6
    timestamp_us: int | None = None
    flag: str = "-"  # "c" (or the obsolete "+"): printed with KERN_CONT; still a message of its own
    fields: dict[str, str] = field(default_factory=dict)  # dictionary lines, e.g. DEVICE=+pci:0000:3b:00.0
    facility: int = KERNEL_FACILITY  # syslog facility from the header prefix; headerless lines count as kernel


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
    """One record (header line plus optional dictionary or dmesg continuation lines); a headerless line is a bare
    message."""
    lines = text.rstrip("\n").split("\n")
    head = lines[0]
    if not head.strip():
        return None
    fields: dict[str, str] = {}
    more: list[str] = []
    for line in lines[1:]:
        if _DICT_LINE.match(line):
            key, _, value = line.strip().partition("=")
            fields[key] = unescape(value)
        elif line.startswith((" ", "\t")) and line.strip():
            more.append(unescape(line.strip()))  # dmesg indents the further lines of a multi-line message
    match = _HEADER.match(head)
    if match is None:
        message = unescape(_DMESG_PREFIX.sub("", head, count=1))
        return KmsgRecord("\n".join([message, *more]), fields=fields)
    prefix, seq, usec, flag, message = match.groups()
    return KmsgRecord("\n".join([unescape(message), *more]), int(seq), int(prefix) & 7, int(usec),
                      flag.strip() or "-", fields, int(prefix) >> 3)


def read_boot_id(path: str | Path = "/proc/sys/kernel/random/boot_id") -> str:
    """This boot's id, or "" when it cannot be read."""
    try:
        return Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError as exc:
        log.warning("cannot read boot id from %s (%s); a reboot will not be recognised", path, exc)
        return ""


class KmsgReader:
    """Non-blocking reader of /dev/kmsg or a plain file; `read_available()` returns what is there now."""

    def __init__(self, path: str | Path, boot_id: str, cursor: KmsgCursor | None = None, *,
                 read: Callable[[int, int], bytes] = os.read, seek: Callable[[int, int, int], int] = os.lseek,
                 batch_limit: int = 5000) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.lost = 0  # records overwritten before we read them (EPIPE and sequence gaps)
        self.resyncs = 0  # sequence numbers that could not be real (went back, leapt, cursor ahead of the kernel)
        self._cursor = cursor if cursor is not None and cursor.boot_id == boot_id else None
        self._read = read
        self._seek = seek
        self._batch_limit = batch_limit
        self._fd: int | None = None
        self._device = False
        self._inode: int | None = None
        self._offset = 0
        self._last_seq = self._cursor.seq if self._cursor else None
        self._skip_through: int | None = None  # a device replays from its oldest record: skip up to the cursor
        self._prev_seq: int | None = None  # the record before, in this open's stream

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
        self._prev_seq = None
        self._skip_through = self._last_seq if self._device else None  # a file resumes at its byte offset
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
        """New records (each its own message; already-seen ones skipped), and whether more are waiting."""
        if self._fd is None:
            raise RuntimeError("KmsgReader.open() first")
        raw, more = self._read_device() if self._device else self._read_file()
        records: list[KmsgRecord] = []
        for text in raw:
            record = parse_record(text)
            if record is not None and self._new(record):
                records.append(record)
        if not more and self._cursor_ahead_of_kernel():
            return records, True
        return records, more

    def _new(self, record: KmsgRecord) -> bool:
        seq = record.seq
        if seq is None:
            return True
        prev, self._prev_seq = self._prev_seq, seq
        if prev is not None and seq <= prev:
            self._resync(f"sequence number went back from {prev} to {seq}")
            self._skip_through, self._last_seq = None, seq
            return True
        if self._skip_through is not None and seq <= self._skip_through:
            return False
        self._skip_through = None  # past the cursor: from here on the stream's own order decides
        last = self._last_seq
        if last is not None and seq > last + 1:
            if seq - last - 1 > MAX_SEQ_JUMP:
                self._resync(f"sequence number leapt from {last} to {seq}")
            else:
                self.lost += seq - last - 1
        self._last_seq = seq
        return True

    def _cursor_ahead_of_kernel(self) -> bool:
        """At the end of the buffer with every record skipped as 'seen': the cursor is not this kernel's.
        Read the buffer again from its oldest record rather than skip everything up to an unreachable number."""
        skip, seen = self._skip_through, self._prev_seq
        if not self._device or skip is None or seen is None or seen >= skip:
            return False
        self._resync(f"saved position {skip} is ahead of the newest kernel record {seen}")
        assert self._fd is not None
        self._seek(self._fd, 0, os.SEEK_SET)
        self._skip_through = self._last_seq = self._prev_seq = None
        return True

    def _resync(self, why: str) -> None:
        self.resyncs += 1
        if self.resyncs & (self.resyncs - 1) == 0:  # 1st, 2nd, 4th, 8th...: a hostile file cannot flood the log
            log.warning("kernel log %s: %s; following the records as they come (%d such)", self.path, why,
                        self.resyncs)

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
