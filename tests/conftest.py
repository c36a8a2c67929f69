"""Test-wide fixtures (the shared fakes live in tests/fakes/), and the leak guard every test runs under.

A test that leaves an asyncio task or a thread running fails (kopf's `_no_asyncio_pending_tasks` idea): a loop
nobody stops in a test is a loop nobody stops in the agent. Stragglers get a short grace to finish (a
cancelled task needs a turn of the loop to end), then they are cancelled and named in the failure.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.fakes.fixtures"]

GRACE = 10.0  # seconds for stragglers to end by themselves (slow on a loaded machine); a guard, not a timing assertion


def pytest_configure(config: pytest.Config) -> None:
    """Temporary files in RAM where there is room. The simulated sysfs trees are thousands of small files: on the
    VM's shared disk one took 5-7 s to write (three tree-heavy test files: 114 s), in /dev/shm 16 s. A TMPDIR the
    caller chose wins; without a writable tmpfs of 2 GiB the default stays."""
    shm = Path("/dev/shm")
    if os.environ.get("TMPDIR") or not shm.is_dir() or not os.access(shm, os.W_OK | os.X_OK):
        return
    try:
        if shutil.disk_usage(shm).free < 2 << 30:
            return
        root = shm / f"gpu-node-agent-tests-{os.getuid()}"
        root.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return
    if root.is_symlink() or root.stat().st_uid != os.getuid():
        return  # somebody else's: keep the default
    os.environ["TMPDIR"] = str(root)  # the agents the tests start write their scratch trees there too
    tempfile.tempdir = str(root)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every coroutine test runs under the task guard, set up first so it is torn down last (after the
    fixtures that stop their own servers)."""
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.fixturenames.insert(0, "_no_leaked_tasks")


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    yield
    current = asyncio.current_task()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GRACE
    while True:
        leaked = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if not leaked or loop.time() > deadline:
            break
        await asyncio.sleep(0.01)
    for task in leaked:
        task.cancel()
    await asyncio.gather(*leaked, return_exceptions=True)
    names = [f"{t.get_name()} {t.get_coro()!r}" for t in leaked]
    assert not leaked, f"tasks still running after the test: {names}"



@pytest.fixture
def short_root() -> Iterator[Path]:
    """A scratch directory with a short path: unix socket paths must stay under 107 bytes; tmp_path may not."""
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)

def _foreign(thread: threading.Thread) -> bool:
    """Threads the test does not own: asyncio's executor workers (ended with their loop), library pools, and
    grpc.aio's completion-queue poller (one per process, started with the first channel or server)."""
    return thread.name.startswith(("asyncio_", "ThreadPoolExecutor-")) or "(_poll_wrapper)" in thread.name \
        or not thread.is_alive()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + GRACE
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and not _foreign(t)]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not leaked, f"threads still running after the test: {[t.name for t in leaked]}"
