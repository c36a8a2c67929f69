"""Many NIC pool entries: the served-name duplicate check counted each name in the whole list (quadratic, the
pattern fixed for time-slicing entries in issue 37, item 1): 19,000 aliased copies of one pool in the agent's file
took 3.9 s of CPU to refuse (33,000, about the most its 100,000-value limit lets through, 11.6 s; now 1.0 s, most of
it YAML parsing). `config` and `run` refuse them with one line, exit 2, within 1 s of this process's CPU. (The SR-IOV
plugin's file is capped at 256 resources.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent import cli

ENTRIES = 19_000
AGENT = "\n".join(["devicePlugin:", "  pools:", "  - &p {resourceName: r}", *["  - *p"] * (ENTRIES - 1)]) + "\n"


@pytest.mark.parametrize("command", ["config", "run"])
def test_thousands_of_copies_of_one_pool_are_refused_within_a_second(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(AGENT)
    started = time.process_time()  # this process's CPU: not inflated by other work on a loaded machine
    assert cli.main([command, "--config", str(path)]) == 2
    took = time.process_time() - started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "gpunodeagent.io/r is configured twice" in err, err
    assert took < 1.0, f"{took:.2f} s of CPU"
