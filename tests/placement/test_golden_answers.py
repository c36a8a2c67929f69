"""The preferred-allocation answers on the pre-existing profiles are those of the commit before issue 43's
locality work (1b51839): issue 43's "the DGX H100 answers are unchanged", for dgx-h100, pcie-pairs and
dgx-h100-mig (whole GPUs, MIG slices, RDMA VFs; NIC after GPU and NIC first; must_include, subset offers, held
devices), in joint mode with and without the kubelet's facts and in NIC-only mode, every request over the
plugins' unix sockets as the kubelet sends it.

The fixture was recorded at 1b51839 by `tests/placement/golden_answers.py` (its `source` field names the commit
and the command); regenerate it only on purpose, when a change of answers is meant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.placement.golden_answers import RESOURCE, replay
from tests.placement.golden_node import MODES, PROFILES

FIXTURE = Path(__file__).parent / "fixtures" / "answers-1b51839.json"
RECORDED = json.loads(FIXTURE.read_text())
RUNS = {(run["profile"], run["mode"]): run for run in RECORDED["runs"]}


def answers(run: dict) -> list[dict]:
    return [e for e in run["log"] if "p" in e]


def test_the_fixture_names_its_source_and_covers_what_it_claims() -> None:
    source = RECORDED["source"]
    assert source["commit"].startswith("1b51839") and "golden_answers.py" in source["command"]
    assert set(RUNS) == {(p, m) for p in PROFILES for m in MODES}
    assert sum(len(answers(run)) for run in RUNS.values()) >= 1500
    for (profile, mode), run in RUNS.items():
        asked = answers(run)
        assert len(asked) >= 90, (profile, mode)
        gpu_kinds = {a for a, r in RESOURCE.items() if r in PROFILES[profile][1]}
        ours = {"nic"} if mode == "nic-only" else {"nic", *gpu_kinds}
        assert {e["r"] for e in asked} == ours, (profile, mode)
        assert sum(bool(e["m"]) for e in asked) >= 5, (profile, mode)  # must_include offers
        pods = [[r for r, _ in e["q"]] for e in run["log"] if "pod" in e]
        assert any(q[0] == "nic" and len(q) == 2 for q in pods), (profile, mode)  # NIC first
        assert any(q[-1] == "nic" and len(q) == 2 for q in pods), (profile, mode)  # NIC after GPU


@pytest.mark.parametrize(("profile", "mode"), sorted(RUNS), ids=[f"{p}-{m}" for p, m in sorted(RUNS)])
async def test_answers_are_those_of_1b51839(profile: str, mode: str) -> None:
    run = RUNS[profile, mode]
    compared, differences = await replay(run)
    assert compared == len(answers(run))
    assert not differences, "\n".join(
        f"container {d.container} {d.resource}: 1b51839 {d.expected}, now {d.got}" for d in differences)
