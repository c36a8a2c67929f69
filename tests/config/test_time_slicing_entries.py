"""Many time-slicing entries (issue 37, item 1): 19,000 aliases of one `sharing.timeSlicing.resources` entry took
7.4 s of CPU to refuse (a quadratic duplicate check); whichever file carries them, `config` and `run` refuse them
with one line, exit 2, within 1 s of this process's CPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent import cli

ENTRIES = 19_000


def _aliases(head: list[str], indent: str, entry: str) -> str:
    return "\n".join([*head, f"{indent}- &e {entry}", *[f"{indent}- *e"] * (ENTRIES - 1)]) + "\n"


NVIDIA = _aliases(["version: v1", "sharing:", "  timeSlicing:", "    resources:"], "    ",
                  "{name: gpu, replicas: 4}")
AGENT = _aliases(["devicePlugin:", "  timeSlicing:", "    resources:"], "    ",
                 "{name: nvidia.com/gpu, replicas: 4}")


@pytest.mark.parametrize(("flag", "text"), [("--nvidia-dp-config", NVIDIA), ("--config", AGENT)])
@pytest.mark.parametrize("command", ["config", "run"])
def test_thousands_of_aliased_entries_are_refused_within_a_second(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  flag: str, text: str, command: str) -> None:
    path = tmp_path / "sliced.yaml"
    path.write_text(text)
    started = time.process_time()  # this process's CPU: not inflated by other work on a loaded machine
    assert cli.main([command, flag, str(path)]) == 2
    took = time.process_time() - started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "nvidia.com/gpu" in err and "listed twice" in err, err
    assert took < 1.0, f"{took:.2f} s of CPU"


def test_distinct_entries_still_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sliced.yaml"
    path.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n"
                    "    - {name: mig-1g.10gb, replicas: 2}\n")
    assert cli.main(["config", "--nvidia-dp-config", str(path)]) == 0
