"""The bpf(2) syscall through ctypes: maps, program loads with the verifier's log, pins, tcx links, queries.

The only module that issues bpf(2). Every object comes back as a file descriptor the caller owns (close it with
os.close); errors raise BpfError with the errno and the command's name, and a refused program load raises
VerifierError carrying the verifier's own lines. Attribute layouts are `union bpf_attr` of include/uapi/linux/bpf.h
(byte offsets in reference ebpf-accounting §1); a zeroed buffer larger than the fields set is accepted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import struct
from dataclasses import dataclass

_NR_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
ATTR_SIZE = 128

# enum bpf_cmd
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY, PROG_LOAD, OBJ_PIN, OBJ_GET = range(8)
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 14, 15, 16
MAP_LOOKUP_BATCH, LINK_CREATE, LINK_UPDATE, LINK_DETACH = 24, 28, 29, 34
_NAMES = {MAP_CREATE: "MAP_CREATE", MAP_LOOKUP_ELEM: "MAP_LOOKUP_ELEM", MAP_UPDATE_ELEM: "MAP_UPDATE_ELEM",
          MAP_DELETE_ELEM: "MAP_DELETE_ELEM", MAP_GET_NEXT_KEY: "MAP_GET_NEXT_KEY", PROG_LOAD: "PROG_LOAD",
          OBJ_PIN: "OBJ_PIN", OBJ_GET: "OBJ_GET", PROG_GET_FD_BY_ID: "PROG_GET_FD_BY_ID",
          MAP_GET_FD_BY_ID: "MAP_GET_FD_BY_ID", OBJ_GET_INFO_BY_FD: "OBJ_GET_INFO_BY_FD", PROG_QUERY: "PROG_QUERY",
          MAP_LOOKUP_BATCH: "MAP_LOOKUP_BATCH", LINK_CREATE: "LINK_CREATE", LINK_UPDATE: "LINK_UPDATE",
          LINK_DETACH: "LINK_DETACH"}

# map types, map flags, update flags
MAP_HASH, MAP_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY = 1, 2, 5, 6
F_NO_PREALLOC = 1
ANY, NOEXIST, EXIST = 0, 1, 2
# program and attach types
PROG_SCHED_CLS = 3
TCX_INGRESS, TCX_EGRESS = 46, 47
BPF_FS_MAGIC = 0xCAFE4A11


class BpfError(OSError):
    """A bpf(2) command failed."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}")


class VerifierError(BpfError):
    """The verifier refused a program: `log` holds its lines (the last ones say why)."""

    def __init__(self, err: int, name: str, log: str) -> None:
        super().__init__(err, f"PROG_LOAD {name}")
        self.log = log

    def tail(self, lines: int = 8) -> str:
        """The verifier's last lines, joined with ' | ' for one log line."""
        return " | ".join(line for line in self.log.strip().splitlines()[-lines:])


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _nr() -> int:
    machine = platform.machine()
    if machine not in _NR_BPF:
        raise BpfError(errno.ENOSYS, f"bpf(2) on {machine}")
    return _NR_BPF[machine]


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    ret = _libc.syscall(ctypes.c_long(_nr()), ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfError(err, _NAMES.get(cmd, str(cmd)))
    return int(ret)


def _attr(*fields: tuple[str, int, int]) -> ctypes.Array[ctypes.c_char]:
    """A zeroed attr buffer with (struct format, offset, value) fields packed in."""
    buf = ctypes.create_string_buffer(ATTR_SIZE)
    for fmt, offset, value in fields:
        struct.pack_into("<" + fmt, buf, offset, value)
    return buf


def _addr(buf: ctypes.Array[ctypes.c_char] | None) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


def possible_cpus() -> int:
    """The number of possible CPUs (per-CPU map values have one slot each): /sys/devices/system/cpu/possible."""
    with open("/sys/devices/system/cpu/possible", encoding="ascii") as f:
        text = f.read().strip()
    count = 0
    for part in text.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


# -- maps ---------------------------------------------------------------------------------------------------------

def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, *, name: str, flags: int = 0) -> int:
    """A new map's fd."""
    attr = _attr(("I", 0, map_type), ("I", 4, key_size), ("I", 8, value_size), ("I", 12, max_entries),
                 ("I", 16, flags))
    struct.pack_into("15s", attr, 28, name[:15].encode())
    return _bpf(MAP_CREATE, attr)


def map_update(fd: int, key: bytes, value: bytes, flags: int = ANY) -> bool:
    """Set a key; False when `flags` is NOEXIST and the key exists (its value is kept)."""
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    try:
        _bpf(MAP_UPDATE_ELEM, _attr(("I", 0, fd), ("Q", 8, _addr(k)), ("Q", 16, _addr(v)), ("Q", 24, flags)))
    except BpfError as exc:
        if exc.errno == errno.EEXIST and flags == NOEXIST:
            return False
        raise
    return True


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """A key's value (all CPUs' slots for a per-CPU map), or None."""
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    try:
        _bpf(MAP_LOOKUP_ELEM, _attr(("I", 0, fd), ("Q", 8, _addr(k)), ("Q", 16, _addr(v))))
    except BpfError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    return v.raw


def map_delete(fd: int, key: bytes) -> bool:
    """Delete a key; False when it was not there."""
    k = ctypes.create_string_buffer(key, len(key))
    try:
        _bpf(MAP_DELETE_ELEM, _attr(("I", 0, fd), ("Q", 8, _addr(k))))
    except BpfError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """Every key, by GET_NEXT_KEY (for maps or kernels without batch lookups)."""
    keys: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    prev: ctypes.Array[ctypes.c_char] | None = None
    while True:
        try:
            _bpf(MAP_GET_NEXT_KEY, _attr(("I", 0, fd), ("Q", 8, _addr(prev)), ("Q", 16, _addr(nxt))))
        except BpfError as exc:
            if exc.errno == errno.ENOENT:
                return keys
            raise
        keys.append(nxt.raw)
        prev = ctypes.create_string_buffer(nxt.raw, key_size)


def map_dump(fd: int, key_size: int, value_size: int, room: int, *, once: bool = False,
             start: int = 0) -> tuple[bytes, bytes]:
    """Every key and value, concatenated (keys, values), with as few syscalls as `room` entries per call allow
    (MAP_LOOKUP_BATCH, kernel 5.6). `value_size` is the whole value as user space sees it (all CPUs' slots for a
    per-CPU map). Whole buffers, so a caller decodes thousands of entries with one struct.iter_unpack. `once`: only
    the first `room` entries (an array's leading indexes), one call. `start`: an array's first index to read (the
    kernel takes the batch token as the key before it)."""
    room = max(room, 1)
    keys, values = ctypes.create_string_buffer(key_size * room), ctypes.create_string_buffer(value_size * room)
    token_in, token_out = ctypes.create_string_buffer(max(key_size, 8)), ctypes.create_string_buffer(max(key_size, 8))
    out_keys: list[bytes] = []
    out_values: list[bytes] = []
    first = start <= 0
    if not first:
        ctypes.memmove(token_in, (start - 1).to_bytes(key_size, "little"), key_size)
    while True:
        attr = _attr(("Q", 0, 0 if first else _addr(token_in)), ("Q", 8, _addr(token_out)), ("Q", 16, _addr(keys)),
                     ("Q", 24, _addr(values)), ("I", 32, room), ("I", 36, fd))
        done = False
        try:
            _bpf(MAP_LOOKUP_BATCH, attr)
        except BpfError as exc:
            if exc.errno != errno.ENOENT:
                raise
            done = True
        count = struct.unpack_from("<I", attr, 32)[0]
        out_keys.append(keys.raw[:count * key_size])
        out_values.append(values.raw[:count * value_size])
        if done or once:
            return b"".join(out_keys), b"".join(out_values)
        ctypes.memmove(token_in, token_out, len(token_out))
        first = False


def map_lookup_batch(fd: int, key_size: int, value_size: int, room: int) -> list[tuple[bytes, bytes]]:
    """Every (key, value), by MAP_LOOKUP_BATCH (see map_dump)."""
    keys, values = map_dump(fd, key_size, value_size, room)
    return [(keys[i * key_size:(i + 1) * key_size], values[i * value_size:(i + 1) * value_size])
            for i in range(len(keys) // key_size)]


# -- programs -----------------------------------------------------------------------------------------------------

def prog_load(prog_type: int, insns: bytes, name: str, expected_attach_type: int = 0,
              log_size: int = 256 * 1024) -> int:
    """Load a program; VerifierError with the verifier's log when refused. The log is only asked for on a retry
    after a refusal, so an accepted program costs no log formatting."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    for log_level in (0, 1):
        log = ctypes.create_string_buffer(log_size) if log_level else None
        attr = _attr(("I", 0, prog_type), ("I", 4, len(insns) // 8), ("Q", 8, _addr(code)), ("Q", 16, _addr(lic)),
                     ("I", 24, log_level), ("I", 28, log_size if log else 0), ("Q", 32, _addr(log)),
                     ("I", 68, expected_attach_type))
        struct.pack_into("15s", attr, 48, name[:15].encode())
        try:
            return _bpf(PROG_LOAD, attr)
        except BpfError as exc:
            if log is not None or exc.errno not in (errno.EACCES, errno.EINVAL):
                text = log.value.decode(errors="replace") if log is not None else ""
                raise VerifierError(exc.errno or errno.EINVAL, name, text) from None
    raise AssertionError("unreachable")


# -- pins ---------------------------------------------------------------------------------------------------------

def obj_pin(fd: int, path: str) -> None:
    """Pin an object at `path` on a bpf filesystem."""
    p = ctypes.create_string_buffer(path.encode())
    _bpf(OBJ_PIN, _attr(("Q", 0, _addr(p)), ("I", 8, fd)))


def obj_get(path: str) -> int:
    """An fd of the object pinned at `path` (FileNotFoundError when nothing is)."""
    p = ctypes.create_string_buffer(path.encode())
    try:
        return _bpf(OBJ_GET, _attr(("Q", 0, _addr(p))))
    except BpfError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"no bpf object pinned at {path}") from None
        raise


def is_bpffs(path: str) -> bool:
    """Whether `path` is (on) a bpf filesystem."""
    buf = ctypes.create_string_buffer(128)  # struct statfs: f_type is its first field
    if _libc.statfs(path.encode(), buf) != 0:
        return False
    return bool(struct.unpack_from("<q", buf, 0)[0] == BPF_FS_MAGIC)


def _mount(path: str) -> None:
    if _libc.mount(b"bpf", path.encode(), b"bpf", ctypes.c_ulong(0), None) != 0:
        err = ctypes.get_errno()
        raise BpfError(err, f"mount bpffs at {path}")


def mount_bpffs(path: str) -> None:
    """Make `path` a directory on a bpf filesystem: create it, or mount bpffs on its parent where the parent is a
    directory nothing can be created in (the usual /sys/fs/bpf of sysfs, where the distribution mounted none), or
    on `path` itself when it is on another filesystem. A no-op when it is on bpffs already."""
    if os.path.isdir(path) and is_bpffs(path):
        return
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        parent = os.path.dirname(path.rstrip("/"))
        if not os.path.isdir(parent) or is_bpffs(parent):
            raise
        _mount(parent)
        os.makedirs(path, mode=0o700, exist_ok=True)
    if not is_bpffs(path):
        _mount(path)


# -- links and queries --------------------------------------------------------------------------------------------

def link_create(prog_fd: int, ifindex: int, attach_type: int) -> int:
    """A tcx link: the program appended to the hook of `ifindex` (resolved in this thread's network namespace)."""
    return _bpf(LINK_CREATE, _attr(("I", 0, prog_fd), ("I", 4, ifindex), ("I", 8, attach_type)))


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the link's program atomically (same link, same hook position)."""
    _bpf(LINK_UPDATE, _attr(("I", 0, link_fd), ("I", 4, prog_fd)))


def link_detach(link_fd: int) -> None:
    """Detach the link from its hook (the link object lives on until its last fd and pin go)."""
    _bpf(LINK_DETACH, _attr(("I", 0, link_fd)))


def prog_query(ifindex: int, attach_type: int, room: int = 64) -> tuple[list[int], list[int]]:
    """(program ids, link ids) on a tcx hook, in order."""
    progs, links = ctypes.create_string_buffer(4 * room), ctypes.create_string_buffer(4 * room)
    attr = _attr(("I", 0, ifindex), ("I", 4, attach_type), ("Q", 16, _addr(progs)), ("I", 24, room),
                 ("Q", 40, _addr(links)))
    _bpf(PROG_QUERY, attr)
    count = struct.unpack_from("<I", attr, 24)[0]
    ids = list(struct.unpack_from(f"<{count}I", progs, 0))
    link_ids = list(struct.unpack_from(f"<{count}I", links, 0))
    return ids, link_ids


def prog_fd_by_id(prog_id: int) -> int:
    """An fd of a loaded program (needs CAP_SYS_ADMIN)."""
    return _bpf(PROG_GET_FD_BY_ID, _attr(("I", 0, prog_id)))


def _info(fd: int, size: int) -> bytes:
    info = ctypes.create_string_buffer(size)
    _bpf(OBJ_GET_INFO_BY_FD, _attr(("I", 0, fd), ("I", 4, size), ("Q", 8, _addr(info))))
    return info.raw


@dataclass(frozen=True)
class ProgInfo:
    """What bpf_prog_info says about a program."""

    prog_type: int
    id: int
    name: str


@dataclass(frozen=True)
class LinkInfo:
    """What bpf_link_info says about a link (tcx: ifindex 0 once its device is gone)."""

    link_type: int
    id: int
    prog_id: int
    ifindex: int
    attach_type: int


@dataclass(frozen=True)
class MapInfo:
    """What bpf_map_info says about a map."""

    map_type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    name: str


def prog_info(fd: int) -> ProgInfo:
    """A program's type, id and name."""
    raw = _info(fd, 256)
    prog_type, prog_id = struct.unpack_from("<II", raw, 0)
    return ProgInfo(prog_type, prog_id, raw[64:80].split(b"\0")[0].decode(errors="replace"))


def link_info(fd: int) -> LinkInfo:
    """A link's type, id, program and (for tcx) device and direction."""
    raw = _info(fd, 64)
    link_type, link_id, prog_id = struct.unpack_from("<IIII", raw, 0)[:3]
    ifindex, attach_type = struct.unpack_from("<II", raw, 16)
    return LinkInfo(link_type, link_id, prog_id, ifindex, attach_type)


def map_info(fd: int) -> MapInfo:
    """A map's type, id, sizes and name."""
    raw = _info(fd, 128)
    map_type, map_id, key_size, value_size, entries = struct.unpack_from("<IIIII", raw, 0)
    return MapInfo(map_type, map_id, key_size, value_size, entries, raw[24:40].split(b"\0")[0].decode(errors="replace"))


PROG_TEST_RUN = 10
_NAMES[PROG_TEST_RUN] = "PROG_TEST_RUN"


def prog_test_run(prog_fd: int, packet: bytes, repeat: int = 1, ctx: bytes | None = None) -> tuple[int, int]:
    """Run a loaded program on a packet (from its Ethernet header) without any device: (return value, mean ns
    per run). SCHED_CLS test runs see `pkt_type` PACKET_HOST for a zero destination MAC; `ctx` (a struct
    __sk_buff) sets the fields the kernel lets a test run set (ingress_ifindex among them)."""
    data = ctypes.create_string_buffer(packet, len(packet))
    context = ctypes.create_string_buffer(ctx, len(ctx)) if ctx else None
    attr = _attr(("I", 0, prog_fd), ("I", 8, len(packet)), ("Q", 16, _addr(data)), ("I", 32, repeat),
                 ("I", 40, len(ctx) if ctx else 0), ("Q", 48, _addr(context)))
    _bpf(PROG_TEST_RUN, attr)
    retval, = struct.unpack_from("<i", attr, 4)
    duration, = struct.unpack_from("<I", attr, 36)
    return retval, duration


ENABLE_STATS, STATS_RUN_TIME = 32, 0
_NAMES[ENABLE_STATS] = "ENABLE_STATS"


def enable_stats() -> int:
    """Have the kernel time every program run while the returned fd is open (kernel 5.8; global, like the
    kernel.bpf_stats_enabled sysctl, but undone when the fd closes, even if the process dies)."""
    return _bpf(ENABLE_STATS, _attr(("I", 0, STATS_RUN_TIME)))


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program: what it ran while stats were enabled."""
    run_time, runs = struct.unpack_from("<QQ", _info(fd, 256), 192)
    return run_time, runs
