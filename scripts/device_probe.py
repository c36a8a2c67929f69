"""The NVML paths behind health, once each, against the real driver: what `scripts/device_check.sh` records.

Read-only: the inventory (versions, GPU basics, call support), every GPU's NVLink / fabric / recovery-action
state (`gpu_state`, timed as one pass over all GPUs, what `--gpu-state-interval` costs on this node), memory
health (ECC, retired pages, remapped rows), the process lists a GPU reset waits for, and one event-set wait.
Prints one JSON document.

    python scripts/device_probe.py --event-wait 2 > nvml_probes.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from agent.host.nvml import NvmlError, RealNvml


def _call(call: Any) -> Any:
    started = time.perf_counter()
    try:
        value = call()
    except NvmlError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "ms": (time.perf_counter() - started) * 1000}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return {"value": value, "ms": (time.perf_counter() - started) * 1000}


def probe(event_wait: float) -> dict[str, Any]:
    """Every probe once; errors are recorded, never raised."""
    nvml = RealNvml()
    out: dict[str, Any] = {"available": nvml.available, "unavailable_reason": nvml.unavailable_reason}
    if not nvml.available:
        return out
    out["inventory"] = _call(nvml.inventory)
    uuids = sorted(nvml.gpu_uuids().values())
    out["gpus"] = {}
    for uuid in uuids:
        out["gpus"][uuid] = {"gpu_state": _call(lambda u=uuid: nvml.gpu_state(u)),
                             "memory_health": _call(lambda u=uuid: nvml.memory_health(u)),
                             "running_processes": _call(lambda u=uuid: nvml.running_processes(u))}
    passes = []
    for _ in range(20):
        started = time.perf_counter()
        for uuid in uuids:
            nvml.gpu_state(uuid)
        passes.append((time.perf_counter() - started) * 1000)
    out["gpu_state_pass_ms"] = {"min": min(passes), "median": sorted(passes)[len(passes) // 2], "max": max(passes)}

    def events() -> dict[str, Any]:
        events = nvml.open_events(uuids)
        try:
            started = time.perf_counter()
            seen = events.wait(event_wait)
            waited = (time.perf_counter() - started) * 1000
            return {"events": [dataclasses.asdict(e) for e in seen], "waited_ms": waited}
        finally:
            events.close()
    out["event_set"] = _call(events)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--event-wait", type=float, default=2.0, help="seconds of one event-set wait")
    json.dump(probe(parser.parse_args().event_wait), sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
