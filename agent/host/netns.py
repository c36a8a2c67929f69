"""Enter a named network namespace for the span of a `with` block, on this thread only.

Network namespaces are per thread: a socket opened while the thread is inside one stays in it after the thread
switches back. The agent itself runs in the host's namespace; the netlink ports take an `ip netns` name so tests
and benches can point them at a namespace of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: str | None) -> Iterator[None]:
    """Run the body with this thread inside network namespace `netns` (an `ip netns` name); None: stay."""
    if netns is None:
        yield
        return
    with open("/proc/thread-self/ns/net", "rb") as home, open(f"/run/netns/{netns}", "rb") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())
