"""The GPU reset overlay (overlays/gpu-reset) (validated strictly in test_overlays): runs privileged, and sets a reset
command the agent's config accepts, which the agent expands to nvidia-smi's documented reset call."""

from __future__ import annotations

from agent import config as agent_config
from agent.host.gpu_reset import ResetTarget, reset_argv
from tests.deploy.manifests import render_overlay


def test_the_reset_command_is_accepted_and_expands_to_nvidia_smis_reset() -> None:
    (daemonset,) = [d for d in render_overlay("gpu-reset") if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"  # the toolkit mounts nvidia-smi
    cfg = agent_config.load(None, {k: v for k, v in env.items() if v is not None})
    assert cfg.remediation.gpu_resets
    uuid = "GPU-6dcfcd8c-6683-51ff-867b-21d848804070"
    assert reset_argv(cfg.remediation.gpu_reset_command, ResetTarget(uuid, "0000:9d:00.0", 4)) == \
        ["nvidia-smi", "--gpu-reset", "-i", uuid]
