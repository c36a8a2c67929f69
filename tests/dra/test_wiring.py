"""With --dra the device plugin serves only what the DRA driver does not: one device, one API."""

from __future__ import annotations

import dataclasses

from agent.config.model import AgentConfig, DevicePluginConfig, DraConfig
from agent.node import device_plugin_beside_dra


def test_dra_takes_gpus_and_rdma_and_the_device_plugin_steps_aside() -> None:
    cfg = AgentConfig(dra=DraConfig(enabled=True), device_plugin=DevicePluginConfig(serve_gpus=True))
    assert not device_plugin_beside_dra(cfg).device_plugin.enabled


def test_dra_for_vfs_only_leaves_the_gpus_to_the_device_plugin() -> None:
    cfg = AgentConfig(dra=DraConfig(enabled=True, gpus=False), device_plugin=DevicePluginConfig(serve_gpus=True))
    dp = device_plugin_beside_dra(cfg).device_plugin
    assert dp.enabled and dp.serve_gpus and dp.pools == []


def test_dra_for_gpus_only_leaves_the_nic_pools() -> None:
    cfg = AgentConfig(dra=DraConfig(enabled=True, rdma=False), device_plugin=DevicePluginConfig(serve_gpus=True))
    dp = device_plugin_beside_dra(cfg).device_plugin
    assert dp.enabled and not dp.serve_gpus and [p.resource_name for p in dp.pools] == ["sriov_rdma"]


def test_without_dra_nothing_changes() -> None:
    cfg = AgentConfig(device_plugin=DevicePluginConfig(serve_gpus=True))
    assert device_plugin_beside_dra(cfg) == cfg
    assert device_plugin_beside_dra(dataclasses.replace(cfg, dra=DraConfig(enabled=True, gpus=False, rdma=False))) \
        .device_plugin.enabled
