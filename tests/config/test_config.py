"""Config: defaults < file < environment < flags, and every bad value exits 2 naming the field and value."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from agent import cli, config
from agent.config.load import _flagged_fields


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return parser.parse_args(argv)


def test_defaults_give_one_rdma_pool_and_no_gpu_pool():
    cfg = config.load(_parse([]), {})
    assert cfg.topology.sysfs_root == "/sys"
    assert cfg.device_plugin.serve_gpus is None  # decided at start: on only in simulate mode
    assert [p.resource_name for p in cfg.device_plugin.pools] == ["sriov_rdma"]
    assert cfg.device_plugin.pools[0].selectors.is_rdma is True


def test_file_env_and_flags_override_in_that_order(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({
        "nodeName": "from-file",
        "topology": {"sysfsRoot": "/file/sys", "rescanIntervalSeconds": 60},
        "devicePlugin": {"resourcePrefix": "example.com", "pools": [
            {"resourceName": "ib", "selectors": {"linkTypes": ["infiniband"], "isRdma": True}},
            {"resource_name": "eth", "selectors": {"vendors": ["15b3"]}},  # snake_case accepted too
        ]},
    }))
    env = {"NODE_NAME": "from-env", "GPU_NODE_AGENT_SYSFS_ROOT": "/env/sys"}
    cfg = config.load(_parse(["--config", str(path), "--sysfs-root", "/flag/sys"]), env)
    assert cfg.node_name == "from-env"
    assert cfg.topology.sysfs_root == "/flag/sys"
    assert cfg.topology.rescan_interval_seconds == 60.0
    assert cfg.device_plugin.resource_prefix == "example.com"
    assert [p.resource_name for p in cfg.device_plugin.pools] == ["ib", "eth"]
    assert cfg.device_plugin.pools[0].selectors.link_types == ["infiniband"]
    assert cfg.device_plugin.pools[1].selectors.vendors == ["15b3"]


def test_json_files_and_boolean_flags(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"devicePlugin": {"serveGpus": True}}))
    assert config.load(_parse(["--config", str(path)]), {}).device_plugin.serve_gpus is True
    assert config.load(_parse(["--config", str(path), "--no-serve-gpus"]), {}).device_plugin.serve_gpus is False
    assert config.load(_parse([]), {"GPU_NODE_AGENT_SERVE_GPUS": "yes"}).device_plugin.serve_gpus is True


@pytest.mark.parametrize(("content", "named"), [
    ({"topology": {"rescanIntervalSeconds": "soon"}}, ["topology.rescanIntervalSeconds", "'soon'"]),
    ({"devicePlugin": {"serveGpus": "maybe"}}, ["devicePlugin.serveGpus", "'maybe'"]),
    ({"logLevel": "chatty"}, ["logLevel", "'chatty'"]),
    ({"devicePlugin": {"pools": [{"resourceName": "x", "selectors": {"vendorz": ["1"]}}]}},
     ["devicePlugin.pools[0].selectors.vendorz", "unknown setting"]),
    ({"topology": ["not", "a", "mapping"]}, ["topology", "expected a mapping"]),
    ({"devicePlugin": {"pools": "sriov_rdma"}}, ["devicePlugin.pools[0]"]),
])
def test_invalid_values_exit_2_naming_the_field_and_value(tmp_path, capsys, content, named):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(content))
    assert cli.main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err


def test_invalid_flag_and_env_values_exit_2(capsys, monkeypatch):
    assert cli.main(["config", "--rescan-interval", "x"]) == 2
    assert "rescanIntervalSeconds" in capsys.readouterr().err
    monkeypatch.setenv("GPU_NODE_AGENT_LOG_FORMAT", "xml")
    assert cli.main(["config"]) == 2
    assert "'xml'" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "problem"), [
    ("topology: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_malformed_files_exit_2(tmp_path, capsys, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["config", "--config", str(path)]) == 2
    assert problem in capsys.readouterr().err


def test_missing_file_exits_2(tmp_path, capsys):
    assert cli.main(["config", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_config_command_prints_the_effective_config(capsys):
    assert cli.main(["config", "--serve-gpus", "--node-name", "n7"]) == 0
    dumped = yaml.safe_load(capsys.readouterr().out)
    assert dumped["nodeName"] == "n7"
    assert dumped["devicePlugin"]["serveGpus"] is True
    # what `config` prints is a valid config file
    assert config.load(None, {}).version == dumped["version"]


def test_run_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flags = [f.field.metadata["flag"] for f in _flagged_fields(config.AgentConfig) if f.field.metadata["flag"]]
    assert flags, "no flags found"
    for flag in [*flags, "--config"]:
        assert flag in text
    for item in _flagged_fields(config.AgentConfig):
        if item.field.metadata.get("env"):
            assert item.field.metadata["env"] in text


def test_bad_metrics_address_exits_2(capsys):
    assert cli.main(["config", "--metrics-address", "9400"]) == 2
    assert "'9400'" in capsys.readouterr().err


def test_the_lookup_deadline_is_a_setting_with_a_flag_and_an_env_variable(tmp_path):
    assert config.load(_parse([]), {}).pod_resources.lookup_timeout_seconds == 0.05  # sized by a measured p99
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"podResources": {"lookupTimeoutSeconds": 0.02}}))
    assert config.load(_parse(["--config", str(path)]), {}).pod_resources.lookup_timeout_seconds == 0.02
    env = {"GPU_NODE_AGENT_POD_RESOURCES_LOOKUP_TIMEOUT": "0.03"}
    assert config.load(_parse(["--config", str(path)]), env).pod_resources.lookup_timeout_seconds == 0.03
    flags = _parse(["--config", str(path), "--pod-resources-lookup-timeout", "0.1"])
    assert config.load(flags, env).pod_resources.lookup_timeout_seconds == 0.1


def test_a_bare_yaml_on_or_off_is_the_word_for_an_on_off_setting(tmp_path):
    """YAML 1.1 reads `off` as false: `nodeLabels.mode: off` and `gfd: on` mean what the operator wrote."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "config.yaml"
    path.write_text("nodeLabels:\n  mode: off\n  gfd: on\n")
    done = subprocess.run([sys.executable, "-m", "agent", "config", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    labels = yaml.safe_load(done.stdout)["nodeLabels"]
    assert (labels["mode"], labels["gfd"]) == ("off", "on")
    path.write_text("nodeLabels:\n  mode: on\n")  # `on` is no mode of nodeLabels: still one line, exit 2
    done = subprocess.run([sys.executable, "-m", "agent", "config", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and "nodeLabels.mode" in done.stderr and "Traceback" not in done.stderr
