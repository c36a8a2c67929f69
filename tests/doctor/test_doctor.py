"""`gpu-node-agent doctor` (issue 31): every check ok or skip on a simulated node; on a broken node the broken
checks fail with their fix and the exit code is 1; the JSON matches the schema in docs/doctor.md; RBAC without a verb
fails naming it; and a run changes nothing in the sysfs tree or the state directory.

In-process through `agent.cli.main` and `agent.doctor.diagnose`; subprocesses only for the exit codes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import cli, config
from agent.doctor import Check, diagnose, exit_code, node_checks
from agent.doctor.context import resolve
from agent.hardware import Hardware
from agent.host.links import SysfsLinkPort
from agent.simulate.node import build_simulated_node
from agent.topology.model import Topology
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock

ROOT = Path(__file__).resolve().parents[2]


def _config(*flags: str) -> config.AgentConfig:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.load(parser.parse_args(list(flags)), {})


def _schema() -> dict[str, Any]:
    text = (ROOT / "docs" / "doctor.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- doctor-schema -->\s*```json\n(.*?)```", text, re.DOTALL)
    assert block, "docs/doctor.md lost the doctor JSON schema"
    schema: dict[str, Any] = json.loads(block.group(1))
    return schema


def _validate(value: Any, schema: dict[str, Any], where: str = "$") -> None:
    """The subset of JSON Schema the documented schema uses: type, required, properties, additionalProperties,
    items, enum."""
    kinds = {"object": dict, "array": list, "string": str}
    assert isinstance(value, kinds[schema["type"]]), f"{where}: not a {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if schema["type"] == "object":
        assert set(schema.get("required", ())) <= set(value), f"{where}: missing {set(schema['required']) - set(value)}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), f"{where}: extra {set(value) - set(schema['properties'])}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{where}.{key}")
    if schema["type"] == "array":
        for index, item in enumerate(value):
            _validate(item, schema["items"], f"{where}[{index}]")


def test_the_validator_refuses_what_the_schema_does_not_allow():
    with pytest.raises(AssertionError, match="not in"):
        _validate({"checks": [{"name": "x", "status": "bad", "detail": "", "fix": ""}]}, _schema())
    with pytest.raises(AssertionError, match="missing"):
        _validate({"checks": [{"name": "x", "status": "ok", "detail": ""}]}, _schema())


def test_a_simulated_node_is_all_ok_or_skip_and_the_json_matches_the_documented_schema(capsys):
    assert cli.main(["doctor", "--simulate", "dgx-h100", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    _validate(document, _schema())
    statuses = {c["name"]: c["status"] for c in document["checks"]}
    assert set(statuses.values()) <= {"ok", "skip"}, statuses
    for name in ("nvml", "nvml.gpu7", "nvml.calls", "sysfs.topology", "sysfs.rdma", "sysfs.vfs", "sysfs.counters",
                 "sysfs.pcie", "sysfs.iommu", "kubelet.device-plugins", "kubelet.pod-resources", "state-dir", "clock"):
        assert statuses[name] == "ok", name
    rows = {c["name"]: c for c in document["checks"]}
    assert "List answered in" in rows["kubelet.pod-resources"]["detail"]  # real gRPC to the stand-in kubelet
    assert "PIX 8" in rows["sysfs.topology"]["detail"]


def test_the_table_names_each_check_and_the_counts(capsys):
    assert cli.main(["doctor", "--simulate", "pcie-pairs"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^OK +sysfs\.vfs +mlx5_0: 4/", out, re.MULTILINE)
    assert out.rstrip().splitlines()[-1].endswith("0 fail, 7 skip")  # sriov-dp-config: none set


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    node = build_simulated_node("pcie-pairs", tmp_path / "sys")
    yield node.sysfs_root, node.nvml


def _hardware(root: Path, nvml: Any) -> Hardware:
    """The tree read as a host's /sys (not a simulated node: the configured kubelet paths count)."""
    hardware = Hardware(nvml=nvml, sysfs_root=root, topology_file=None, topology=Topology(), links=SysfsLinkPort(root))
    hardware.rescan()
    return hardware


def _remove_rdma(root: Path) -> None:
    shutil.rmtree(root / "class" / "infiniband")
    for path in (root / "devices").rglob("infiniband*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def silent_socket(tmp_path: Path) -> Iterator[str]:
    """A unix socket that is listening but never answers (a hung kubelet)."""
    path = str(tmp_path / "pr.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    try:
        yield path
    finally:
        server.close()


def _broken_flags(tmp_path: Path, silent: str) -> list[str]:
    return ["--kmsg", str(tmp_path / "no-such-kmsg"), "--device-plugin-dir", str(tmp_path / "no-device-plugins"),
            "--pod-resources-socket", silent, "--state-dir", str(tmp_path / "state"),
            "--plugin-registry-dir", str(tmp_path / "no-registry"), "--cdi-spec-dir", str(tmp_path / "no-cdi")]


async def test_a_broken_node_fails_those_four_checks_with_their_fixes(tmp_path, tree, silent_socket):
    root, nvml = tree
    _remove_rdma(root)
    cfg = _config("--sysfs-root", str(root), *_broken_flags(tmp_path, silent_socket))
    checks = await diagnose(cfg, _hardware(root, nvml), tmp_path / "scratch")
    failed = {c.name: c for c in checks if c.status == "fail"}
    assert set(failed) == {"sysfs.rdma", "kmsg", "kubelet.device-plugins", "kubelet.pod-resources"}, checks
    assert all(c.fix for c in failed.values())
    assert "no RDMA device" in failed["sysfs.rdma"].detail
    assert "no-such-kmsg" in failed["kmsg"].detail and "CAP_SYSLOG" in failed["kmsg"].fix
    assert "no-device-plugins" in failed["kubelet.device-plugins"].detail
    assert "DEADLINE_EXCEEDED" in failed["kubelet.pod-resources"].detail
    assert exit_code(checks) == 1


def _snapshot(*roots: Path) -> dict[str, tuple[Any, ...]]:
    found: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                info = path.lstat()
                content: Any = os.readlink(path) if path.is_symlink() else \
                    hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
                found[str(path)] = (info.st_mode, info.st_size, info.st_mtime_ns, content)
    return found


async def test_a_doctor_run_is_read_only(tmp_path, tree):
    root, nvml = tree
    state = tmp_path / "state"
    state.mkdir()
    (state / "health.json").write_text('{"bootId": "x"}')
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,100,-;NVRM: loading\n")
    before = _snapshot(root, state, kmsg.parent)
    cfg = _config("--sysfs-root", str(root), "--state-dir", str(state), "--kmsg", str(kmsg),
                  "--device-plugin-dir", str(tmp_path / "dp"), "--pod-resources-socket", "")
    checks = await diagnose(cfg, _hardware(root, nvml), tmp_path / "scratch")
    assert {c.name: c.status for c in checks}["kmsg"] == "ok"
    after = _snapshot(root, state, kmsg.parent)
    after = {k: v for k, v in after.items() if not k.startswith(str(tmp_path / "scratch"))}
    assert after == before


async def test_rbac_without_patch_nodes_fails_naming_the_verb(tmp_path, tree):
    root, nvml = tree
    api = ApiServerDouble(FakeClock())
    api.denied = {("", "nodes", "patch")}
    url = await api.start()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "kc", url)
        cfg = _config("--sysfs-root", str(root), "--kubeconfig", str(kubeconfig), "--node-name", api.node_name,
                      "--remediation", "--pod-resources-socket", "", "--state-dir", str(tmp_path / "state"))
        checks = await diagnose(cfg, _hardware(root, nvml), tmp_path / "scratch", has_credentials=True)
    finally:
        await api.stop()
    rows: dict[str, Check] = {c.name: c for c in checks}
    assert rows["api"].status == "ok" and api.node_name in rows["api"].detail
    assert rows["api.rbac"].status == "fail"
    assert "remediation: patch nodes" in rows["api.rbac"].detail
    assert "patch nodes/status" not in rows["api.rbac"].detail  # only the denied verb is named
    assert rows["api.rbac"].fix
    reviews = [r for r in api.requests if r.path.endswith("/selfsubjectaccessreviews")]
    assert reviews and all(r.method == "POST" for r in reviews)
    assert not [r for r in api.requests if r.method not in ("GET", "POST")]  # nothing written


async def test_rbac_with_every_verb_allowed_is_ok(tmp_path, tree):
    root, nvml = tree
    api = ApiServerDouble(FakeClock())
    url = await api.start()
    try:
        cfg = _config("--sysfs-root", str(root), "--kubeconfig", str(write_kubeconfig(tmp_path / "kc", url)),
                      "--node-name", api.node_name, "--remediation", "--dra", "--pod-resources-socket", "")
        checks = await diagnose(cfg, _hardware(root, nvml), tmp_path / "scratch", has_credentials=True)
    finally:
        await api.stop()
    rbac = next(c for c in checks if c.name == "api.rbac")
    assert rbac.status == "ok" and "remediation" in rbac.detail and "dra" in rbac.detail


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "doctor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


def test_exit_codes(tmp_path, tree, silent_socket):
    root, _ = tree
    _remove_rdma(root)
    broken = _doctor("--sysfs-root", str(root), *_broken_flags(tmp_path, silent_socket))
    assert broken.returncode == 1, broken.stderr
    assert re.search(r"^FAIL +kubelet\.device-plugins", broken.stdout, re.MULTILINE)
    assert "fix: " in broken.stdout
    bad = _doctor("--no-such-flag")
    assert bad.returncode == 2
    assert _doctor("--simulate", "no-such-profile").returncode == 2


def _path_without_nft(tmp_path: Path) -> str:
    """A PATH holding every tool of this machine except nft (the binary really absent, as on a node without it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name != "nft" and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(directory, name))
    return str(bin_dir)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("ipset"),
                    reason="needs root, nft and ipset (CI installs them)")
def test_the_netacct_check_names_the_layout_it_will_use(tmp_path, tree, monkeypatch):
    root, nvml = tree

    def check(*flags: str) -> Check:
        cfg = _config("--sysfs-root", str(root), "--netacct", *flags)
        return node_checks.netacct(resolve(cfg, _hardware(root, nvml), tmp_path / "scratch"))

    preferred = check()  # auto: the eBPF layout where bpf(2) answers (root here)
    assert preferred.status == "ok" and preferred.detail.startswith("eBPF layout: bpf(2) answers")
    native = check("--netacct-layout", "nft")
    assert native.status == "ok" and "native nftables layout" in native.detail and "probe" not in native.detail
    assert check("--netacct-layout", "iptables").detail.startswith("iptables layout: iptables ")
    monkeypatch.setenv("PATH", _path_without_nft(tmp_path))
    fallback = check("--netacct-layout", "auto", "--bpffs-dir", "/sys/fs/bpf/gpu-node-agent")
    assert fallback.status == "ok" and fallback.detail.startswith("eBPF layout")  # nft's absence does not matter
    refused = check("--netacct-layout", "nft")
    assert refused.status == "fail" and "nft is not installed" in refused.detail and "nftables" in refused.fix
