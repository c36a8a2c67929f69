"""Settings of the shaping subsystem: per-pod limits on internet traffic (tc on the pods' host interfaces).

Internet vs cluster is the node's internal set (`--internal-cidr`, `agent.config.pods`), the one netacct counts
by, so the two subsystems always agree on what "internet" means. Namespace defaults are checked at load time, so
a typo exits with code 2 naming the entry.

Bandwidths are Kubernetes quantities read as bits per second, as the CNI bandwidth plugin reads
`kubernetes.io/egress-bandwidth` (k8s.io/apimachinery `resource.ParseQuantity`, then `Value()`, which rounds
up to an integer): decimal suffixes `k M G T P E`, binary `Ki Mi Gi Ti Pi Ei`, exponents `e3`/`E3`, and `m`
(milli). Like the kubelet's bandwidth validation (kubernetes `pkg/util/bandwidth`), a value under 1k or over 1P
is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.config.fields import setting
from agent.config.numbers import NumberError, ceil_int, parse_quantity, shown

DIRECTIONS = ("egress", "ingress")  # egress = pod uploads, ingress = pod downloads
MIN_BPS, MAX_BPS = 1000, 10**15


def parse_bandwidth(text: str) -> int:
    """A quantity such as `100M` or `1G` as bits per second; ValueError with a reason otherwise (never another
    exception, and never slow: `agent.config.numbers` bounds the text and the exponent before any arithmetic)."""
    bps = ceil_int(parse_quantity(text), text)
    if bps < MIN_BPS:
        raise NumberError(f"{shown(text)} is unreasonably small (< 1k bits per second)")
    if bps > MAX_BPS:
        raise NumberError(f"{shown(text)} is unreasonably large (> 1P bits per second)")
    return bps


@dataclass(frozen=True)
class Limits:
    """Bits per second per direction; None = unshaped."""

    egress: int | None = None
    ingress: int | None = None

    def get(self, direction: str) -> int | None:
        """The limit of `direction` ("egress" or "ingress")."""
        return self.egress if direction == "egress" else self.ingress

    def __bool__(self) -> bool:
        return self.egress is not None or self.ingress is not None


def parse_defaults(defaults: Mapping[str, Mapping[str, str]]) -> dict[str, Limits]:
    """`{namespace: {egress: "50M", ingress: "100M"}}` -> Limits; ValueError naming the bad entry."""
    out: dict[str, Limits] = {}
    for namespace, entry in defaults.items():
        unknown = set(entry) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"namespaceDefaults.{namespace}: unknown keys {sorted(unknown)} (egress, ingress)")
        values: dict[str, int | None] = {}
        for direction in DIRECTIONS:
            text = entry.get(direction)
            try:
                values[direction] = None if text is None else parse_bandwidth(str(text))
            except ValueError as exc:
                raise ValueError(f"namespaceDefaults.{namespace}.{direction}: {exc}") from None
        out[namespace] = Limits(**values)
    return out


def _no_defaults() -> dict[str, dict[str, str]]:
    return {}


@dataclass
class ShapingConfig:
    """Per-pod internet bandwidth shaping."""

    enabled: bool = setting(False, flag="--shaping", env="GPU_NODE_AGENT_SHAPING",
                            help="limit each pod's internet traffic (only; cluster traffic runs unshaped) from "
                                 "its gpunodeagent.io/internet-{egress,ingress}-bandwidth annotations and the "
                                 "namespace defaults; needs NET_ADMIN and the host network namespace")
    namespace_defaults: dict[str, dict[str, str]] = setting(
        factory=_no_defaults,
        help='default limits per namespace, {namespace: {egress: "50M", ingress: "100M"}} (bits per second, '
             "Kubernetes quantities); either direction may be left out (unshaped)")
    sync_interval_seconds: float = setting(
        30.0, flag="--shaping-sync-interval", env="GPU_NODE_AGENT_SHAPING_SYNC_INTERVAL",
        floor=1.0, help="seconds between full re-checks of the shapers (pod changes are applied at once)")
    retry_seconds: float = setting(
        2.0, flag="--shaping-retry", env="GPU_NODE_AGENT_SHAPING_RETRY",
        floor=0.1, help="seconds before looking again for a pod whose host-side interface was not found yet")

    def check(self) -> None:
        """Reject bad defaults and non-positive intervals (the loader reports them with exit code 2)."""
        parse_defaults(self.namespace_defaults)
        if not self.sync_interval_seconds > 0 or not self.retry_seconds > 0:
            raise ValueError("syncIntervalSeconds and retrySeconds must be positive")
