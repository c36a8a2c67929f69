"""The type checker as a test: `mypy` (configured in pyproject.toml) finds nothing in `agent/`.

CI runs `mypy` too; running it here as well means a change that breaks the port Protocols or a signature fails
the suite a developer runs before landing, not only CI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_agent_type_checks_clean():
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
