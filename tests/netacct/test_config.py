"""netacct settings: flags, environment, defaults and validation (exit code 2 naming the field)."""

from __future__ import annotations

import argparse

import pytest

from agent import cli, config
from agent.config.netacct import NetacctConfig
from agent.config.pods import DEFAULT_INTERNAL_CIDRS


def load(argv: list[str], env: dict[str, str] | None = None) -> NetacctConfig:
    """Parse flags as `gpu-node-agent run` does and return the netacct section."""
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.load(parser.parse_args(argv), env or {}).netacct


def test_defaults() -> None:
    cfg = load([])
    assert not cfg.enabled
    assert cfg.internal_cidrs == list(DEFAULT_INTERNAL_CIDRS)
    assert cfg.layout == "auto" and cfg.backend == "auto" and cfg.per_pod_metrics and cfg.ipv6 and cfg.pods_file is None


def test_flags() -> None:
    cfg = load(["--netacct", "--internal-cidr", "10.0.0.0/8", "--internal-cidr", "fd00::/8",
                "--pods-file", "/etc/pods.json", "--no-netacct-per-pod", "--netacct-backend", "legacy",
                "--netacct-sync-interval", "5", "--no-netacct-ipv6", "--netacct-lock-wait", "2",
                "--netacct-layout", "iptables"])
    assert cfg.enabled and cfg.internal_cidrs == ["10.0.0.0/8", "fd00::/8"]
    assert cfg.pods_file == "/etc/pods.json" and not cfg.per_pod_metrics and cfg.backend == "legacy"
    assert cfg.sync_interval_seconds == 5.0 and not cfg.ipv6 and cfg.lock_wait_seconds == 2
    assert cfg.layout == "iptables"


def test_environment_and_precedence() -> None:
    env = {"GPU_NODE_AGENT_NETACCT": "true", "GPU_NODE_AGENT_INTERNAL_CIDRS": "10.0.0.0/8, 192.168.0.0/16",
           "GPU_NODE_AGENT_NETACCT_BACKEND": "nft", "GPU_NODE_AGENT_PODS_FILE": "/p.json",
           "GPU_NODE_AGENT_NETACCT_LAYOUT": "nft"}
    cfg = load([], env)
    assert cfg.layout == "nft"
    assert cfg.enabled and cfg.internal_cidrs == ["10.0.0.0/8", "192.168.0.0/16"] and cfg.backend == "nft"
    assert load(["--internal-cidr", "172.16.0.0/12"], env).internal_cidrs == ["172.16.0.0/12"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--internal-cidr", "10.0.0.0/8", "--internal-cidr", "bogus"], "internalCidrs[1]: 'bogus' is not a CIDR"),
    (["--internal-cidr", "10.1.2.3/8"], "did you mean 10.0.0.0/8"),
    (["--netacct-backend", "iptables"], "not one of auto, nft, legacy"),
    (["--netacct-layout", "legacy"], "not one of auto, ebpf, nft, iptables"),
    (["--netacct-sync-interval", "0"], "syncIntervalSeconds: must be positive"),
    (["--bpffs-dir", "gna"], "bpffsDir: must be an absolute path without '.'"),
    (["--bpffs-dir", "/sys/fs/bpf/gna.v2"], "bpffsDir: must be an absolute path without '.'"),
])
def test_invalid_values_name_the_field(argv: list[str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(argv)


def test_cli_exits_2_on_a_bad_cidr(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "--internal-cidr", "300.0.0.0/8"]) == 2
    assert "internalCidrs[0]" in capsys.readouterr().err


def test_internal_networks() -> None:
    nets = NetacctConfig(internal_cidrs=["10.0.0.0/8", " fd00::/8", "192.0.2.7"]).internal_networks()
    assert [str(n) for n in nets] == ["10.0.0.0/8", "fd00::/8", "192.0.2.7/32"]
