"""/dev/kmsg records: parsing, continuation (dictionary) lines, fragments, files, EPIPE, cursors, fuzzing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.host.kmsg import KmsgCursor, KmsgReader, KmsgRecord, parse_record, read_boot_id

BOOT = "boot-a"


@pytest.mark.parametrize(("text", "expected"), [
    ("6,339,5140900,-;NET: Registered PF_INET6 protocol family\n",
     KmsgRecord("NET: Registered PF_INET6 protocol family", 339, 6, 5140900, "-")),
    # facility bits above the level; unknown extra header fields are ignored; the text starts after the first ;
    ("30,340,5141000,-,caller=T1;systemd[1]: a;b;c\n",
     KmsgRecord("systemd[1]: a;b;c", 340, 6, 5141000, "-", facility=3)),
    # continuation lines: key/value properties of the record, escaped bytes undone
    ("3,341,5142000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n"
     " DEVICE=+pci:0000:3b:00.0\n",
     KmsgRecord("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", 341, 3, 5142000, "-",
                {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3b:00.0"})),
    ("4,342,5143000,c;tab\\x09here back\\x5cslash\n", KmsgRecord("tab\there back\\slash", 342, 4, 5143000, "c")),
    # a plain file may hold lines without the header, or dmesg's format
    ("NVRM: Xid (PCI:0000:1b:00): 79, pid=1\n", KmsgRecord("NVRM: Xid (PCI:0000:1b:00): 79, pid=1")),
    ("[ 1234.567890] NVRM: Xid (PCI:0000:1b:00): 48, x\n", KmsgRecord("NVRM: Xid (PCI:0000:1b:00): 48, x")),
    ("\n", None),
    # NVIDIA/DCGM dcgmlib/src/tests/DcgmKmsgReaderTests.cpp: the driver's KERN_CONT record, flag c, one message
    ("4,1227,437812449,c;NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, name=cuda_assert_64b, Ch 00000018\n",
     KmsgRecord("NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, name=cuda_assert_64b, Ch 00000018", 1227, 4,
                437812449, "c")),
    # NVIDIA/NVSentinel#155: dmesg prints the further lines of one multi-line message indented
    ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n               NVRM: (PCI ID: 10de:26b5) installed in "
     "this system has\n               NVRM: fallen off the bus and is not responding to commands.\n",
     KmsgRecord("NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system has\n"
                "NVRM: fallen off the bus and is not responding to commands.")),
    # a user-space write to /dev/kmsg: facility LOG_USER (1), level 4 -> prefix 12
    ("12,900,5150000,-;NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n",
     KmsgRecord("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.", 900, 4, 5150000, "-", facility=1)),
])
def test_parse_record(text: str, expected: KmsgRecord | None) -> None:
    assert parse_record(text) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_parse_record_never_raises(text: str) -> None:
    record = parse_record(text)
    assert record is None or isinstance(record.message, str)


def _reader(path: Path, cursor: KmsgCursor | None = None, **kwargs: object) -> KmsgReader:
    reader = KmsgReader(path, BOOT, cursor, **kwargs)
    reader.open()
    return reader


def _messages(reader: KmsgReader) -> list[str]:
    records, more = reader.read_available()
    assert not more
    return [r.message for r in records]


def test_file_follows_appends_and_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("6,1,10,-;one\n")
    reader = _reader(path)
    assert not reader.is_device
    assert _messages(reader) == ["one"]
    assert _messages(reader) == []
    with path.open("a") as log:
        log.write("6,2,20,-;two\n SUBSYSTEM=pci\n6,3,30,-;thr")
    assert _messages(reader) == ["two"]
    with path.open("a") as log:
        log.write("ee\n")
    assert _messages(reader) == ["three"]
    assert reader.cursor() == KmsgCursor(BOOT, 3, path.stat().st_ino, path.stat().st_size)
    reader.close()


def test_continued_records_are_each_their_own_message(tmp_path: Path) -> None:
    """KERN_CONT (`c`) records are separate messages: NVIDIA's driver flags every NVRM line so (the DCGM test
    record above), and joining them glued a whole Xid burst into one message."""
    path = tmp_path / "kmsg"
    path.write_text("4,1,10,c;NVRM: Xid (PCI:0000:1b:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00\n"
                    "4,2,11,c;NVRM: Xid (PCI:0000:1c:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00\n"
                    "6,3,12,-;next\n4,4,13,c;tail\n")
    reader = _reader(path)
    assert _messages(reader) == ["NVRM: Xid (PCI:0000:1b:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00",
                                 "NVRM: Xid (PCI:0000:1c:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00", "next",
                                 "tail"]


def test_an_absurd_sequence_number_in_a_file_does_not_blind_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("6,1,10,-;one\n6,18446744073709551615,11,-;absurd\n6,2,12,-;two\n6,3,13,-;three\n")
    reader = _reader(path)
    assert _messages(reader) == ["one", "absurd", "two", "three"]
    assert reader.lost == 0 and reader.resyncs == 2  # the leap and the way back; no phantom lost records
    with path.open("a") as log:
        log.write("6,4,14,-;four\n")
    assert _messages(reader) == ["four"]
    # a cursor saved with an absurd number still resumes at the file's byte offset
    cursor = reader.cursor()
    reader.close()
    with path.open("a") as log:
        log.write("6,5,15,-;five\n")
    assert _messages(_reader(path, KmsgCursor(BOOT, 10**19, cursor.inode, cursor.offset))) == ["five"]


def test_file_cursor_skips_what_was_read_before(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("6,1,10,-;one\nheaderless old line\n")
    first = _reader(path)
    assert _messages(first) == ["one", "headerless old line"]
    cursor = first.cursor()
    first.close()
    with path.open("a") as log:
        log.write("6,2,20,-;two\n")
    assert _messages(_reader(path, cursor)) == ["two"]
    # another boot: the cursor does not apply
    assert _messages(_reopen(path, "boot-b", cursor)) == ["one", "headerless old line", "two"]


def _reopen(path: Path, boot: str, cursor: KmsgCursor) -> KmsgReader:
    reader = KmsgReader(path, boot, cursor)
    reader.open()
    return reader


def test_truncated_or_replaced_file_is_read_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("6,5,10,-;old five\n6,6,11,-;old six\n")
    reader = _reader(path)
    assert _messages(reader) == ["old five", "old six"]
    path.write_text("6,1,10,-;new\n")  # same inode, shorter: truncated and rewritten
    assert _messages(reader) == ["new"]
    replacement = tmp_path / "kmsg.new"
    replacement.write_text("6,1,10,-;replaced\n")
    os.replace(replacement, path)
    assert _messages(reader) == ["replaced"]


class _FakeDevice:
    """Stands in for read(2) on /dev/kmsg: one record per call, EAGAIN when empty, EPIPE when overrun; lseek to 0
    goes back to the oldest record, as the kernel's devkmsg_llseek(SEEK_SET) does."""

    def __init__(self, items: list[bytes | OSError]) -> None:
        self.items = items
        self.position = 0

    def __call__(self, fd: int, size: int) -> bytes:
        if self.position >= len(self.items):
            raise BlockingIOError(errno.EAGAIN, "empty")
        item = self.items[self.position]
        self.position += 1
        if isinstance(item, OSError):
            raise item
        return item

    def seek(self, fd: int, offset: int, whence: int) -> int:
        assert (offset, whence) == (0, os.SEEK_SET)
        self.position = 0
        return 0


def _device_reader(items: list[bytes | OSError], cursor: KmsgCursor | None = None) -> KmsgReader:
    fake = _FakeDevice(items)
    reader = KmsgReader("/dev/null", BOOT, cursor, read=fake, seek=fake.seek)
    reader.open()
    assert reader.is_device  # /dev/null is a character device too; the fake read supplies the records
    return reader


def test_device_overrun_epipe_is_counted_and_reading_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    reader = _device_reader([b"6,10,1,-;a\n", OSError(errno.EPIPE, "overrun"), b"6,15,2,-;b\n SUBSYSTEM=x\n"])
    records, more = reader.read_available()
    assert [(r.seq, r.message) for r in records] == [(10, "a"), (15, "b")]
    assert records[1].fields == {"SUBSYSTEM": "x"}
    assert reader.lost == 4 and not more
    assert "overwritten" in caplog.text
    assert reader.cursor() == KmsgCursor(BOOT, 15)
    reader.close()


def test_device_restart_skips_sequence_numbers_already_handled() -> None:
    records = [b"6,1,1,-;old\n", b"6,2,2,-;old too\n", b"6,3,3,-;new\n"]
    reader = _device_reader(list(records), KmsgCursor(BOOT, 2))
    assert [r.message for r in reader.read_available()[0]] == ["new"]
    other_boot = _device_reader(list(records), KmsgCursor("boot-before", 2))
    assert [r.message for r in other_boot.read_available()[0]] == ["old", "old too", "new"]


def test_device_cursor_ahead_of_the_kernel_rereads_the_buffer(caplog: pytest.LogCaptureFixture) -> None:
    """A saved sequence number no kernel record reaches (a damaged state file): without a resync every record
    of this boot, and every later one, would count as already handled."""
    device = _FakeDevice([b"6,1,1,-;old\n", b"6,2,2,-;older news\n"])
    reader = KmsgReader("/dev/null", BOOT, KmsgCursor(BOOT, 2**63), read=device, seek=device.seek)
    reader.open()
    first, more = reader.read_available()
    assert first == [] and more  # everything skipped, then the resync: read again
    again, more = reader.read_available()
    assert [r.message for r in again] == ["old", "older news"] and not more
    device.items.append(b"6,3,3,-;new\n")
    assert [r.message for r in reader.read_available()[0]] == ["new"]
    assert reader.resyncs == 1 and "ahead of the newest kernel record" in caplog.text


def test_device_other_errors_propagate() -> None:
    reader = _device_reader([OSError(errno.EIO, "io")])
    with pytest.raises(OSError, match="io"):
        reader.read_available()


def test_device_backlog_is_read_in_batches() -> None:
    reader = KmsgReader("/dev/null", BOOT, read=_FakeDevice([f"6,{i},1,-;m{i}\n".encode() for i in range(5)]),
                        batch_limit=2)  # 0..4: a fresh reader has no cursor to resync
    reader.open()
    batches = [reader.read_available() for _ in range(3)]
    assert [([r.message for r in recs], more) for recs, more in batches] == [
        (["m0", "m1"], True), (["m2", "m3"], True), (["m4"], False)]


def test_real_dev_kmsg_reads_without_error() -> None:
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    reader = KmsgReader("/dev/kmsg", BOOT)
    try:
        reader.open()
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be opened: {exc}")
    assert reader.is_device
    records, _ = reader.read_available()
    assert all(r.seq is not None for r in records)
    reader.close()


def test_boot_id(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("abc\n")
    assert read_boot_id(tmp_path / "boot_id") == "abc"
    assert read_boot_id(tmp_path / "missing") == ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=80), st.binary(max_size=80)), max_size=8))
def test_file_reader_never_raises_on_garbage(tmp_path: Path, chunks: list[str | bytes]) -> None:
    path = tmp_path / "fuzz"
    path.write_bytes(b"")
    reader = _reader(path)
    try:
        for chunk in chunks:
            with path.open("ab") as log:
                log.write(chunk.encode("utf-8", "surrogatepass") if isinstance(chunk, str) else chunk)
            reader.read_available()
    finally:
        reader.close()
