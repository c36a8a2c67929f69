"""Typed settings of the agent; see `model` for the fields and `load` for how they are read."""

from agent.config.load import ConfigError, add_flags, load, to_mapping
from agent.config.model import (
    AgentConfig,
    ApiServerConfig,
    DevicePluginConfig,
    PodResourcesConfig,
    PoolConfig,
    SelectorConfig,
    TopologyConfig,
)

__all__ = [
    "AgentConfig",
    "ApiServerConfig",
    "ConfigError",
    "DevicePluginConfig",
    "PodResourcesConfig",
    "PoolConfig",
    "SelectorConfig",
    "TopologyConfig",
    "add_flags",
    "load",
    "to_mapping",
]
