"""Hostile and broken configuration: every case is one clear line naming the field and exit 2, in `config` and
in `run` alike, before anything starts (issue 14, item 3 and the node name of item 4)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from agent import cli
from agent.config.model import AgentConfig
from tests.fakes.cli import run_agent


@pytest.mark.parametrize(("content", "named"), [
    # intervals: finite and positive (0 spun a core, nan broke asyncio's timer order, inf never fired)
    ("topology: {rescanIntervalSeconds: .nan}", ["topology.rescanIntervalSeconds", "finite"]),
    ("topology: {rescanIntervalSeconds: .inf}", ["topology.rescanIntervalSeconds", "finite"]),
    ("topology: {rescanIntervalSeconds: 0}", ["topology.rescanIntervalSeconds", "must be positive"]),
    ("health: {nvmlPollIntervalSeconds: -5}", ["health.nvmlPollIntervalSeconds", "must be positive"]),
    ("remediation: {drainDeadlineSeconds: 0}", ["remediation.drainDeadlineSeconds", "must be positive"]),
    ("health: {dcgmPcieReplaysPerMinute: .nan}", ["health.dcgmPcieReplaysPerMinute", "finite"]),
    ("health: {linkCheckIntervalSeconds: -1}", ["health.linkCheckIntervalSeconds", "0 or more"]),
    # a schema version this agent does not read
    ("version: 99", ["version: 99"]),
    # resource names and prefixes the kubelet would refuse (the device plugin crash-looped on them)
    ("devicePlugin: {pools: [{resourceName: 'rdma/x'}]}", ["devicePlugin.pools[0]", "'rdma/x'"]),
    ("devicePlugin: {pools: [{resourceName: ''}]}", ["devicePlugin.pools[0]", "resource name ''"]),
    ("devicePlugin: {resourcePrefix: 'Bad_Prefix'}", ["devicePlugin", "resourcePrefix", "'Bad_Prefix'"]),
    ("devicePlugin: {pools: [{resourceName: a, resourcePrefix: kubernetes.io}]}", ["kubernetes.io"]),
    ("devicePlugin: {gpuResourceName: gpu}", ["gpuResourceName", "needs a prefix"]),
    ("devicePlugin: {pools: [{resourceName: a}, {resourceName: a}]}", ["configured twice"]),
    # VF ranges that silently matched nothing
    ("devicePlugin: {pools: [{resourceName: a, selectors: {pfNames: ['ens1f0#0-x']}}]}",
     ["selectors", "pfNames[0]", "'0-x'"]),
    ("devicePlugin: {pools: [{resourceName: a, selectors: {rootDevices: ['0000:18:00.0#5-2']}}]}",
     ["rootDevices[0]", "backwards"]),
    # a node name that put another node's path in the URL
    ("nodeName: gpu-0/../gpu-1", ["nodeName", "'gpu-0/../gpu-1'", "not a valid Kubernetes node name"]),
])
@pytest.mark.parametrize("command", ["config", "run"])
def test_bad_values_exit_2_naming_the_field(tmp_path, capsys, content: str, named: list[str], command: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert cli.main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for text in named:
        assert text in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--rescan-interval", "nan"], "rescanIntervalSeconds"),
    (["--xid-burst-window", "inf"], "xidBurstWindowSeconds"),
    (["--node-name", "GPU_Node"], "nodeName"),
])
def test_bad_flags_exit_2(capsys, flags: list[str], named: str) -> None:
    assert cli.main(["config", *flags]) == 2
    assert named in capsys.readouterr().err


def test_a_non_utf8_node_name_exits_2(capsys, monkeypatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-\udcff")  # os.environ hands undecodable bytes over as surrogates
    assert cli.main(["config"]) == 2
    assert "nodeName" in capsys.readouterr().err


def test_zero_is_allowed_where_it_means_off() -> None:
    assert cli.main(["config", "--link-check-interval", "0", "--preflight-retry", "0"]) == 0


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("case", [
    ("deep.yaml", ("[" * 5000 + "]" * 5000).encode(), "nested more deeply"),
    ("deep.json", ("[" * 100_000 + "]" * 100_000).encode(), "nested more deeply"),
    ("mid.json", json.dumps({"topology": {"a": _nested(20)}}).encode(),
     "nested more deeply"),
    ("latin1.yaml", "nodeName: g\xe9pu\n".encode("latin-1"), "not UTF-8"),
    ("huge.yaml", b"#" * (2 << 20), "more than a config file"),
    # issue 27: numbers past int's digit limit were a ValueError traceback
    ("bigint.yaml", b"topology: {rescanIntervalSeconds: " + b"9" * 100_000 + b"}", "larger than any setting"),
    ("bigint.json", b'{"topology": {"rescanIntervalSeconds": ' + b"9" * 100_000 + b"}}", "larger than any setting"),
    ("nan.json", b'{"topology": {"rescanIntervalSeconds": NaN}}', "not a finite number"),
    ("self.yaml", b"a: &a [*a]\n", "refers to a value that contains it"),
])
@pytest.mark.parametrize("command", ["config", "run"])
def test_hostile_files_exit_2(tmp_path, capsys, case: tuple[str, bytes, str], command: str) -> None:
    name, data, problem = case
    path = tmp_path / name
    path.write_bytes(data)
    assert cli.main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err


def test_good_pool_ranges_still_load(tmp_path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"devicePlugin": {"pools": [
        {"resourceName": "rdma_a", "selectors": {"pfNames": ["ens1f0#0-3,6"], "rootDevices": ["0000:18:00.0#1"]}}]}}))
    assert cli.main(["config", "--config", str(path)]) == 0


@pytest.mark.parametrize("value", ["1e999999", "1e9999999", "1e-9999999"])
@pytest.mark.parametrize("command", ["config", "run"])
def test_huge_namespace_default_bandwidths_exit_2_at_once(tmp_path, capsys, value: str, command: str) -> None:
    """Issue 27: `1e9999999` ended in a traceback (decimal.Overflow), `1e999999` took 25 s."""
    path = tmp_path / "shaping.yaml"
    path.write_text(f"shaping: {{namespaceDefaults: {{team: {{egress: '{value}'}}}}}}\n")
    started = time.process_time()  # this process's CPU: not inflated by other work on a loaded machine
    assert cli.main([command, "--config", str(path)]) == 2
    assert time.process_time() - started < 2  # the million-digit integer took 25 s of CPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "namespaceDefaults.team.egress" in err and "exponent out of range" in err


_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.mark.parametrize("command", ["config", "run"])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, command: str) -> None:
    """Issue 27, item 4: 9^9 values from a 500-byte file; the depth check walked them all (a core, forever)."""
    path = tmp_path / "laughs.yaml"
    path.write_text(_LAUGHS)
    done = run_agent(command, "--config", str(path))  # it spun a core forever: the timeout fails that
    assert done.returncode == 2
    assert "expands to more than 100000 values" in done.stderr and "Traceback" not in done.stderr


def test_modest_yaml_anchors_still_load(tmp_path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("devicePlugin:\n  pools:\n"
                    "  - {resourceName: a, selectors: &rdma {vendors: ['15b3'], isRdma: true}}\n"
                    "  - {resourceName: b, selectors: *rdma}\n")
    assert cli.main(["config", "--config", str(path)]) == 0


@pytest.mark.parametrize("flag", ["--rescan-interval=1e-9", "--link-check-interval=1e-300"])
def test_a_tiny_interval_is_exit_2_with_one_line(flag: str) -> None:
    """Issue 27, item 10: 1e-9 passed "positive" and the loop it paced spun 76-97 % of a core."""
    done = run_agent("config", flag)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "at least 0.01 seconds" in done.stderr and "Traceback" not in done.stderr


def _duration_flags() -> list[tuple[str, str]]:
    from agent.config.load import _flagged_fields, camel_case
    return [(str(item.field.metadata["flag"]), camel_case(item.path[-1])) for item in _flagged_fields(AgentConfig)
            if item.path[-1].endswith("_seconds") and item.hint is float and item.field.metadata.get("flag")]


def test_every_duration_flag_has_the_floor(capsys) -> None:
    flags = _duration_flags()
    assert len(flags) >= 30 and ("--rescan-interval", "rescanIntervalSeconds") in flags
    for flag, name in flags:
        assert cli.main(["config", f"{flag}=0.009"]) == 2, flag
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and name in err and "at least 0.01" in err, err


def test_the_floor_itself_and_zero_where_it_means_off_still_load() -> None:
    assert cli.main(["config", "--rescan-interval=0.01", "--link-check-interval=0", "--preflight-retry=0"]) == 0
