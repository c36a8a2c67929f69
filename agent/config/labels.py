"""Settings of node labels: where they are published, whether GPU Feature Discovery's keys are written, and the
facts an operator may pin (`agent.labels`)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting
from agent.config.names import is_label

LABEL_MODES = ("auto", "nodefeature", "node", "off")
GFD_MODES = ("auto", "on", "off")
MAX_GPUS = 1024  # far above any node; a typo such as 80 for 8 still passes, 10000 does not


@dataclass
class NodeLabelsConfig:
    """Node labels the scheduler can select on: GFD-compatible `nvidia.com/` keys and the agent's own."""

    mode: str = setting(
        "auto", flag="--node-labels", env="GPU_NODE_AGENT_NODE_LABELS", choices=LABEL_MODES,
        help="where node labels go: auto (an NFD NodeFeature where the API serves it, else the Node), "
             "nodefeature, node (patch the Node's own labels, keys the agent owns only), or off")
    gfd: str = setting(
        "auto", flag="--gfd-labels", env="GPU_NODE_AGENT_GFD_LABELS", choices=GFD_MODES,
        help="GPU Feature Discovery's nvidia.com/ keys: auto writes them unless GFD publishes for this node, on "
             "always, off never")
    expected_gpus: int = setting(
        0, flag="--node-labels-expected-gpus", env="GPU_NODE_AGENT_NODE_LABELS_EXPECTED_GPUS",
        help="gpunodeagent.io/gpu.expected; 0 (the default) takes the GPUs found at the first start, kept in the "
             "state directory")
    gfd_namespaces: list[str] = setting(
        factory=lambda: ["gpu-operator"], flag="--gfd-namespace", env="GPU_NODE_AGENT_GFD_NAMESPACES", repeat=True,
        help="namespaces where GFD's NodeFeature nvidia-features-for-<node> is looked for (besides the agent's "
             "own); the agent needs `get nodefeatures` there (deploy/gfd-read)")
    interval_seconds: float = setting(
        30.0, flag="--node-labels-interval", env="GPU_NODE_AGENT_NODE_LABELS_INTERVAL",
        help="seconds between readings of the label facts (driver, GPUs, NIC rates, GFD's presence); a health "
             "change is published at once")

    def check(self) -> None:
        """Namespaces must be names; the GPU count must be plausible."""
        for name in self.gfd_namespaces:
            if not is_label(name):
                raise ValueError(f"gfdNamespaces: {name[:80]!r} is not a namespace name")
        if not 0 <= self.expected_gpus <= MAX_GPUS:
            raise ValueError(f"expectedGpus: {self.expected_gpus} is not between 0 and {MAX_GPUS}")
