"""The agent's command line as a process of its own, for exit codes and for inputs that used to hang it."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Generous for a loaded 2-core machine (starting Python and importing the agent can take seconds there); an
#: input that hangs the agent, which is what these tests guard against, still fails by this timeout.
TIMEOUT_S = 60.0


def run_agent(*args: str, stdin: str | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS`; the test fails (not errors) when it does not finish within `timeout`."""
    try:
        return subprocess.run([sys.executable, "-m", "agent", *args], input=stdin, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpu-node-agent {' '.join(args)[:200]} did not finish within {timeout:.0f} s")
