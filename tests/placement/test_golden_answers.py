"""The preferred-allocation answers on the pre-existing profiles are those of the commit before issue 43's
locality work (1b51839): issue 43's "the DGX H100 answers are unchanged", for dgx-h100, pcie-pairs and
dgx-h100-mig (whole GPUs, MIG slices, RDMA VFs; NIC after GPU and NIC first; must_include, subset offers, held
devices), every request over the plugins' unix sockets as the kubelet sends it.

The fixture was recorded at 1b51839 by `tests/placement/golden_answers.py` (its `source` field names the commit
and the command); regenerate it only on purpose, when a change of answers is meant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.placement.golden_answers import PROFILES, replay

FIXTURE = Path(__file__).parent / "fixtures" / "answers-1b51839.json"
RUNS = {run["profile"]: run for run in json.loads(FIXTURE.read_text())["runs"]}


def test_the_fixture_names_its_source_and_covers_the_profiles() -> None:
    source = json.loads(FIXTURE.read_text())["source"]
    assert source["commit"].startswith("1b51839") and "golden_answers.py" in source["command"]
    assert set(RUNS) == set(PROFILES)
    for run in RUNS.values():
        requests = run["log"]
        assert len(requests) >= 300
        assert {e["r"] for e in requests} == {*PROFILES[run["profile"]][1], "gpunodeagent.io/sriov_rdma"}
        assert sum(bool(e["m"]) for e in requests) >= 20  # must_include offers
        orders = {tuple(e["r"] for e in requests if e["c"] == c) for c in {e["c"] for e in requests}}
        assert any(o[:1] == ("gpunodeagent.io/sriov_rdma",) and len(o) == 2 for o in orders)  # NIC first
        assert any(o[-1:] == ("gpunodeagent.io/sriov_rdma",) and len(o) == 2 for o in orders)  # NIC after GPU


@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_answers_are_those_of_1b51839(profile: str) -> None:
    run = RUNS[profile]
    compared, differences = await replay(run)
    assert compared == len(run["log"])
    assert not differences, "\n".join(
        f"container {d.container} {d.resource}: 1b51839 {d.expected}, now {d.got}" for d in differences)
