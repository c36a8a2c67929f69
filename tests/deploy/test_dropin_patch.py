"""The migration's step 2 (docs/device-plugin.md): `gpu-node-agent dropin-exclusion` turns an old device plugin's
DaemonSet into a JSON patch that keeps it off nodes labelled gpunodeagent.io/drop-in=true and keeps every original
affinity term.

Checked on NVIDIA's static manifest (no affinity) and on its Helm chart's default affinity (three GPU-node terms;
data/nvidia/SOURCES.md), applied with an independent RFC 6902 implementation (jsonpatch) and, where kubectl is
installed, with `kubectl patch --local` as the migration tells an operator to.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from tests.fakes.cli import run_agent

DATA = Path(__file__).parent / "data" / "nvidia"
EXCLUDE = {"key": "gpunodeagent.io/drop-in", "operator": "NotIn", "values": ["true"]}
KUBECTL = shutil.which("kubectl")


def _daemonset(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


def _terms(daemonset: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = daemonset["spec"]["template"]["spec"].get("affinity") or {}
    required = affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return required.get("nodeSelectorTerms", [])


def _patch(daemonset: dict[str, Any]) -> list[dict[str, Any]]:
    done = run_agent("dropin-exclusion", stdin=json.dumps(daemonset))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", ["nvidia-device-plugin.yml", "helm-default-affinity-daemonset.yaml"])
def test_the_exclusion_is_added_to_every_term_and_nothing_else_changes(name: str, tmp_path: Path) -> None:
    original = _daemonset(name)
    patched = jsonpatch.apply_patch(original, _patch(original))
    before, after = _terms(original), _terms(patched)
    if before:  # each original term keeps its expressions and gains the exclusion (terms are ORed)
        assert len(after) == len(before)
        for old, new in zip(before, after, strict=True):
            assert new["matchExpressions"] == [*old["matchExpressions"], EXCLUDE]
    else:
        assert after == [{"matchExpressions": [EXCLUDE]}]
    rest = copy.deepcopy(patched)
    rest["spec"]["template"]["spec"].pop("affinity")
    expected = copy.deepcopy(original)
    expected["spec"]["template"]["spec"].pop("affinity", None)
    assert rest == expected  # only the affinity changed
    assert jsonpatch.apply_patch(patched, _patch(patched)) == patched  # a second run changes nothing

    if KUBECTL is not None:  # the documented command, offline
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(original))
        done = subprocess.run([KUBECTL, "patch", "--local", "-f", str(path), "--type", "json", "-p",
                               json.dumps(_patch(original)), "-o", "json"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert _terms(json.loads(done.stdout)) == after


def test_the_old_merge_patch_would_have_dropped_the_charts_terms() -> None:
    """Why step 2 is not a merge patch: on the Helm chart's affinity it leaves one term, and the plugin spreads to
    every node without the label (CPU-only ones too)."""
    original = _daemonset("helm-default-affinity-daemonset.yaml")
    merge = {"spec": {"template": {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [EXCLUDE]}]}}}}}}}
    merged = jsonpatch.apply_patch(original, [{"op": "replace", "path": "/spec/template/spec/affinity",
                                               "value": merge["spec"]["template"]["spec"]["affinity"]}])
    assert len(_terms(original)) == 3 and len(_terms(merged)) == 1


@pytest.mark.parametrize(("stdin", "message"), [
    ("not json", "not a DaemonSet as JSON"),
    (json.dumps({"kind": "Deployment"}), "expected a DaemonSet"),
    (json.dumps({"kind": "DaemonSet", "spec": {"template": {"spec": {"affinity": []}}}}), "is not an object"),
    ("[" * 100_000, "not a DaemonSet as JSON"),
])
def test_bad_input_is_one_line_and_exit_2(stdin: str, message: str) -> None:
    done = run_agent("dropin-exclusion", stdin=stdin)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
