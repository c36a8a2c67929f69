"""`gpu-node-agent config --actions`: the effective action table, defaults and overrides together."""

from __future__ import annotations

import pytest
import yaml

from agent import cli


def table(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["config", "--actions", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_defaults_and_overrides_are_printed_with_their_source(capsys, monkeypatch):
    monkeypatch.delenv("GPU_NODE_AGENT_XID_ACTIONS", raising=False)
    rows = {row["xid"]: row for row in table(capsys, "--xid-action", "13=cordon", "--xid-action", "999=drain",
                                            "--link-down-action", "cordon")["xidActions"]}
    assert rows[79]["action"] == "drain" and rows[79]["source"].startswith("catalog")
    assert rows[13] == {"xid": 13, "name": "GR_EXCEPTION", "action": "cordon", "source": "override"}
    assert rows[999]["source"] == "override" and rows[999]["action"] == "drain"
    assert rows[43]["action"] == "none"


def test_checks_and_unknown_codes(capsys, monkeypatch):
    monkeypatch.delenv("GPU_NODE_AGENT_LINK_DOWN_ACTION", raising=False)
    out = table(capsys, "--link-down-action", "cordon")
    assert out["checks"]["linkDownAction"] == "cordon" and out["unknownXid"] == "degraded"


def test_a_bad_override_is_a_usage_error(capsys):
    assert cli.main(["config", "--actions", "--xid-action", "48=explode"]) == 2


def test_every_action_setting_and_every_check_is_listed(capsys, monkeypatch):
    from agent.config.health import CHECK_ACTIONS, HealthConfig

    for name in ("GPU_NODE_AGENT_UNKNOWN_HEALTH_ACTION", "GPU_NODE_AGENT_CHECK_ACTIONS"):
        monkeypatch.delenv(name, raising=False)
    out = table(capsys, "--check-action", "gpu_missing=drain")
    settings = {name for name in HealthConfig.__dataclass_fields__ if name.endswith("_action")}
    assert len(out["checks"]) == len(settings) >= 3
    assert out["checks"]["unknownHealthAction"] == "unhealthy"
    rows = {row["check"]: row for row in out["checkActions"]}
    assert rows.keys() == CHECK_ACTIONS.keys()
    assert rows["gpu_missing"] == {"check": "gpu_missing", "action": "drain", "source": "override"}
    assert all(row["source"] == "default" for name, row in rows.items() if name != "gpu_missing")
    assert {row["xid"]: row["action"] for row in out["xidActions"]}[48] == "isolate"
