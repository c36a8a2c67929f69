"""`doctor` checks the node-labels mode in force and its permissions, by access review only (nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.doctor.run import diagnose
from tests.doctor.test_doctor import _config, _hardware, tree  # noqa: F401  (the fixture)
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock


async def _check(tmp_path: Path, root: Path, nvml: object, api: ApiServerDouble, *flags: str):
    url = await api.start()
    try:
        cfg = _config("--sysfs-root", str(root), "--kubeconfig", str(write_kubeconfig(tmp_path / "kc", url)),
                      "--node-name", api.node_name, "--pod-resources-socket", "", *flags)
        checks = await diagnose(cfg, _hardware(root, nvml), tmp_path / "scratch", has_credentials=True)
    finally:
        await api.stop()
    assert not [r for r in api.requests if r.method not in ("GET", "POST")]  # nothing written
    return next(c for c in checks if c.name == "api.node-labels")


@pytest.mark.parametrize(("served", "denied", "expected"), [
    (True, set(), ("ok", "NodeFeature gpu-node-agent-<node> in gpu-node-agent; 3 verbs")),
    (True, {("nfd.k8s-sigs.io", "nodefeatures", "create")},
     ("fail", "denied: create nodefeatures.nfd.k8s-sigs.io in gpu-node-agent")),
    (False, set(), ("ok", "the Node (patch nodes)")),
    (False, {("", "nodes", "patch")}, ("fail", "denied: patch nodes")),
    (True, {("nfd.k8s-sigs.io", "nodefeatures", "get")}, ("fail", "get nodefeatures")),
])
async def test_the_mode_in_force_and_its_verbs(tmp_path, tree, served, denied, expected):  # noqa: F811
    root, nvml = tree
    status, words = expected
    api = ApiServerDouble(FakeClock())
    api.nfd_served, api.denied = served, denied
    check = await _check(tmp_path, root, nvml, api, "--pod-namespace", "gpu-node-agent")
    assert check.status == status and words in check.detail, check
    assert status == "ok" or check.fix


async def test_nodefeature_mode_without_nfd_fails_and_off_skips(tmp_path, tree):  # noqa: F811
    root, nvml = tree
    api = ApiServerDouble(FakeClock())
    api.nfd_served = False
    check = await _check(tmp_path, root, nvml, api, "--pod-namespace", "x", "--node-labels", "nodefeature")
    assert check.status == "fail" and "does not serve" in check.detail and "install" in check.fix
    check = await _check(tmp_path, root, nvml, ApiServerDouble(FakeClock()), "--node-labels", "off")
    assert check.status == "skip"
