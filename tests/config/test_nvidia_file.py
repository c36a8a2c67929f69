"""NVIDIA's config file (`--nvidia-dp-config`, NVIDIA's `CONFIG_FILE`) read as NVIDIA reads it (api/config/v1
config.go `parseConfigFrom`, replicas.go `UnmarshalJSON`, main.go `DisableResourceNamingInConfig`): its flags
become the agent's settings below everything else, its timeSlicing becomes devicePlugin.timeSlicing, and a file
that NVIDIA refuses, or that asks for what the agent does not serve, exits 2 with one line naming it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.cli import main
from agent.config.load import ConfigError, load

DATA = Path(__file__).parent.parent / "deviceplugin" / "data" / "nvidia"
SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: {name}\n      replicas: {replicas}\n"
ENTRY = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_readme_flags_become_the_agents_settings() -> None:
    config = load(None, {"CONFIG_FILE": str(DATA / "readme-flags.yaml")})
    assert config.device_plugin.nvidia_dp_config == str(DATA / "readme-flags.yaml")
    assert config.device_plugin.mig_strategy == "none"
    assert config.health.require_nvml is True  # failOnInitError
    assert config.device_plugin.pass_device_specs is False
    assert config.device_plugin.device_list_strategy == ["envvar"]
    assert config.device_plugin.device_id_strategy == "uuid"


def test_the_file_is_below_the_environment_and_flags_as_nvidias_is(tmp_path: Path) -> None:
    path = write(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceIDStrategy: index\n"
                           "    sharedDevicesAllocationPolicy: packed\n")
    assert load(None, {"CONFIG_FILE": str(path)}).device_plugin.mig_strategy == "mixed"
    both = load(None, {"CONFIG_FILE": str(path), "MIG_STRATEGY": "single"}).device_plugin
    assert (both.mig_strategy, both.device_id_strategy, both.shared_devices_allocation_policy) == \
        ("single", "index", "packed")
    ours = load(None, {"GPU_NODE_AGENT_NVIDIA_DP_CONFIG": str(path), "GPU_NODE_AGENT_MIG_STRATEGY": "none"})
    assert ours.device_plugin.mig_strategy == "none"


def test_time_slicing_as_nvidia_applies_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A name without prefix gets nvidia.com/; `rename` and `devices` are checked, then ignored with NVIDIA's
    warnings; renameByDefault alone renames."""
    path = write(tmp_path, "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
                           "    failRequestsGreaterThanOne: true\n    resources:\n    - name: gpu\n      replicas: 4\n"
                           "      rename: my-gpu\n"
                           "      devices: [0, '1', 'GPU-8c1f55a2-a3b4-4ff2-ac8d-000000000001']\n")
    with caplog.at_level(logging.WARNING):
        sliced = load(None, {"CONFIG_FILE": str(path)}).device_plugin.time_slicing
    assert [(r.name, r.replicas) for r in sliced.resources] == [("nvidia.com/gpu", 4)]
    assert sliced.fail_requests_greater_than_one and sliced.served_name("nvidia.com/gpu") == "nvidia.com/gpu.shared"
    assert "'rename' field" in caplog.text and "'devices' field" in caplog.text


def test_a_json_file_reads_the_same(tmp_path: Path) -> None:
    path = write(tmp_path, '{"version": "v1", "sharing": {"timeSlicing": {"resources": '
                           '[{"name": "nvidia.com/gpu", "replicas": 3}]}}}', "config.json")
    assert load(None, {"CONFIG_FILE": str(path)}).device_plugin.time_slicing.replicas("nvidia.com/gpu") == 3


@pytest.mark.parametrize(("text", "message"), [
    ("version: v2\n", "unknown version: v2"),
    (SLICED.format(name="nvidia.com/gpu", replicas=-1), "number of replicas must be >= 2, got -1"),
    (SLICED.format(name="nvidia.com/gpu", replicas=1), "number of replicas must be >= 2, got 1"),
    (SLICED.format(name="nvidia.com/gpu", replicas="ten"), "replicas: expected an integer, got 'ten'"),
    (SLICED.format(name="nvidia.com/gpu", replicas=10**6), "at most 1024"),
    (SLICED.format(name="Not_A_Name", replicas=2), "incorrect format for resource name 'nvidia.com/Not_A_Name'"),
    ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
     "sharing.mps: MPS sharing is not supported by gpu-node-agent"),
    ("version: v1\nsharing:\n  timeSlicing: {}\n", "sharing.timeSlicing.resources: no resources specified"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n", "no replicas specified"),
    (ENTRY + "      devices: some\n",
     "devices set as 'some' but the only valid string input is 'all'"),
    (ENTRY + "      devices: 0\n",
     "a count of devices must be > 0"),
    (ENTRY + "      devices: [GPU-x]\n",
     "unsupported type for device in devices list: 'GPU-x'"),
    (ENTRY + "    - {name: gpu, replicas: 3}\n",
     "nvidia.com/gpu is listed twice"),
    ("version: v1\nflags:\n  gdsEnabled: true\n", "GDS_ENABLED='true'"),
    ("version: v1\nflags:\n  migStrategy: partial\n", "migStrategy: 'partial' is not one of none, single, mixed"),
    ("version: v1\nflags:\n  plugin:\n    passDeviceSpecs: [1]\n", "flags.plugin.passDeviceSpecs: expected"),
    ("version: v1\nimex:\n  channelIDs: [0]\n", "imex: IMEX channels"),
    ("version: v1\nsharing: [1]\n", "sharing: expected a mapping"),
])
def test_bad_files_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(None, {"CONFIG_FILE": str(path)})
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_cli_exits_2_naming_the_file_and_the_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n"
                           "      replicas: 4\n")
    assert main(["config", "--nvidia-dp-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu-node-agent config: invalid configuration: NVIDIA device plugin config {path}: "
                          "sharing.mps: MPS sharing")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["config", "--nvidia-dp-config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_config_pools_shows_the_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--pools", "--simulate", "dgx-h100", "--nvidia-dp-config",
                 str(DATA / "readme-time-slicing.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("::") == 80 and "nvidia.com/gpu:" in out
