"""Health settings through the real config loader: flags, env, files, and rejected values naming the field."""

from __future__ import annotations

import argparse

import pytest

from agent import config
from agent.config.health import XID_ACTIONS
from agent.signals import Severity


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    health = config.load(_parse([]), {}).health
    assert health.kmsg == "/dev/kmsg"
    assert health.nvml_poll_interval_seconds == 30.0
    assert health.require_nvml is False
    assert health.xid_action_overrides() == {}


def test_flags_and_env() -> None:
    cfg = config.load(_parse(["--kmsg", "/tmp/k", "--xid-action", "109=none", "--xid-action", "63=cordon",
                              "--nvml-poll-interval", "10", "--link-down-action", "cordon", "--require-nvml"]), {})
    assert cfg.health.kmsg == "/tmp/k"
    assert cfg.health.xid_action_overrides() == {109: "none", 63: "cordon"}
    assert cfg.health.nvml_poll_interval_seconds == 10.0
    assert cfg.health.link_down_action == "cordon" and cfg.health.require_nvml
    env = {"GPU_NODE_AGENT_XID_ACTIONS": "109=none, 92=degraded", "GPU_NODE_AGENT_KMSG": "/var/log/k"}
    from_env = config.load(_parse([]), env).health
    assert from_env.xid_action_overrides() == {109: "none", 92: "degraded"} and from_env.kmsg == "/var/log/k"


@pytest.mark.parametrize(("argv", "named"), [
    (["--xid-action", "109=reboot"], "xid action override '109=reboot'"),
    (["--nvml-poll-interval", "0"], "health.nvmlPollIntervalSeconds: must be positive"),
    (["--link-down-action", "panic"], "linkDownAction"),
    (["--dcgm-exporter-url", "localhost:9400/metrics"], "dcgm_exporter_url must be an http"),
    (["--dcgm-scrape-interval", "0"], "health.dcgmScrapeIntervalSeconds: must be positive"),
    (["--dcgm-pcie-replays-per-minute", "-1"], "dcgm_pcie_replays_per_minute must not be negative"),
    (["--dcgm-link-error-action", "reboot"], "dcgmLinkErrorAction"),
])
def test_bad_values_name_the_problem(argv: list[str], named: str) -> None:
    with pytest.raises(config.ConfigError, match=named):
        config.load(_parse(argv), {})


def test_dcgm_source_is_off_by_default_and_set_from_env() -> None:
    assert config.load(_parse([]), {}).health.dcgm_exporter_url == ""
    env = {"GPU_NODE_AGENT_DCGM_EXPORTER_URL": "http://10.0.0.7:9400/metrics"}
    health = config.load(_parse(["--dcgm-scrape-interval", "30"]), env).health
    assert (health.dcgm_exporter_url, health.dcgm_scrape_interval_seconds) == ("http://10.0.0.7:9400/metrics", 30.0)


def test_action_names_match_severities() -> None:
    assert [Severity.parse(name) for name in XID_ACTIONS] == list(Severity)
