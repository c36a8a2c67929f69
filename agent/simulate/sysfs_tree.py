"""A declarative in-memory file tree (directories, files, relative symlinks) written out in one go.

`SysfsTree` is what the simulated-node writer builds and what tests use to build deliberately broken trees
(dangling links, garbage files, missing attributes). Paths are relative POSIX paths from the tree root,
which plays `/sys`. Symlink targets are stored verbatim, so they can be relative like the kernel's
(`../../../devices/pci0000:15/...`) or point nowhere at all.

    tree = SysfsTree()
    tree.add_file("devices/pci0000:00/0000:00:01.0/vendor", "0x8086\\n")
    tree.add_symlink_to("bus/pci/devices/0000:00:01.0", "devices/pci0000:00/0000:00:01.0")
    tree.add_symlink("class/net/eth9", "../../nowhere")  # dangling on purpose
    tree.write(tmp_path)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class Dir:
    """A directory entry."""


@dataclass(frozen=True)
class File:
    """A regular file with its full contents."""

    content: bytes


@dataclass(frozen=True)
class Symlink:
    """A symbolic link; `target` is written as given (normally relative to the link's directory)."""

    target: str


Entry = Dir | File | Symlink


def _key(path: str | PurePosixPath) -> PurePosixPath:
    p = path if type(path) is PurePosixPath else PurePosixPath(path)
    if p.is_absolute() or not p.parts or ".." in p.parts or str(p) == ".":
        raise ValueError(f"tree paths must be relative and stay inside the tree: {str(path)!r}")
    return p


def relative_target(link: str | PurePosixPath, dest: str | PurePosixPath) -> str:
    """The relative symlink target that makes `link` point at `dest` (both paths from the tree root)."""
    return os.path.relpath(str(_key(dest)), str(_key(link).parent))


class SysfsTree:
    """An ordered set of entries keyed by relative path; parent directories are implied and recorded."""

    def __init__(self) -> None:
        self._entries: dict[PurePosixPath, Entry] = {}

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str | PurePosixPath) and PurePosixPath(path) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, path: str | PurePosixPath) -> Entry | None:
        """The entry at `path`, or None."""
        return self._entries.get(_key(path))

    def read(self, path: str | PurePosixPath) -> str:
        """Text of the file at `path`; KeyError when there is no file there."""
        entry = self._entries.get(_key(path))
        if not isinstance(entry, File):
            raise KeyError(f"no file at {str(path)!r}")
        return entry.content.decode()

    def items(self) -> Iterator[tuple[PurePosixPath, Entry]]:
        """All entries, parents before children."""
        for path in sorted(self._entries, key=lambda p: p.parts):
            yield path, self._entries[path]

    def _ensure_parents(self, path: PurePosixPath) -> None:
        # nearest parent first, up to the first directory already recorded: its own parents are recorded too
        missing = []
        parents = path.parents
        for i in range(len(parents) - 1):  # parents[-1] is "."; indexing builds only the parents looked at
            parent = parents[i]
            existing = self._entries.get(parent)
            if existing is None:
                missing.append(parent)
            elif isinstance(existing, Dir):
                break
            else:
                raise ValueError(f"cannot create {str(path)!r}: {str(parent)!r} is not a directory")
        for parent in missing:
            self._entries[parent] = Dir()

    def _put(self, path: str | PurePosixPath, entry: Entry) -> None:
        key = _key(path)
        if isinstance(self._entries.get(key), Dir):
            raise ValueError(f"{str(key)!r} is a directory; remove() it first")
        self._ensure_parents(key)
        self._entries[key] = entry

    def add_dir(self, path: str | PurePosixPath) -> None:
        """A directory (and its parents); no-op when it exists."""
        key = _key(path)
        existing = self._entries.get(key)
        if existing is not None and not isinstance(existing, Dir):
            raise ValueError(f"{str(key)!r} exists and is not a directory")
        self._ensure_parents(key)
        self._entries[key] = Dir()

    def add_file(self, path: str | PurePosixPath, content: str | bytes = "") -> None:
        """A file with `content` (text is UTF-8 encoded); replaces a file or link already there."""
        self._put(path, File(content.encode() if isinstance(content, str) else bytes(content)))

    def add_symlink(self, path: str | PurePosixPath, target: str) -> None:
        """A symlink whose target is written verbatim; replaces a file or link already there."""
        if not target:
            raise ValueError("symlink target must not be empty")
        self._put(path, Symlink(target))

    def add_symlink_to(self, path: str | PurePosixPath, dest: str | PurePosixPath) -> None:
        """A relative symlink at `path` pointing at `dest`, both given from the tree root."""
        self.add_symlink(path, relative_target(path, dest))

    def remove(self, path: str | PurePosixPath) -> None:
        """Drop the entry at `path` and everything below it; KeyError when absent."""
        key = _key(path)
        if key not in self._entries:
            raise KeyError(f"no entry at {str(key)!r}")
        for other in [p for p in self._entries if p == key or key in p.parents]:
            del self._entries[other]

    def write(self, root: Path) -> None:
        """Create the tree under `root` (created when missing). An existing path is an error."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        for rel, entry in self.items():
            dest = os.path.join(root, rel)
            if isinstance(entry, Dir):
                os.mkdir(dest)
            elif isinstance(entry, File):
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    os.write(fd, entry.content)
                finally:
                    os.close(fd)
            else:
                os.symlink(entry.target, dest)
