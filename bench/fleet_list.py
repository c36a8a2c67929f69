"""`gpu-node-agent fleet --json` over a realistic fleet: the whole process's wall time and the LISTs it made.

The HTTP API double (tests/fakes/apifleet.py) serves N nodes built by tests/fakes/fleetnodes.py (~7.8 kB each, as
the API server returns them: labels, managedFields, images, capacity, the kubelet's conditions) with the real
server's paging rules; the command runs as a process of its own, `--rounds` times. The double is Python on the same
cores: a real API server is another machine, so read the figure as the command's cost plus a local server's.

    python bench/fleet_list.py [--nodes 7500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's agent, not an installed one

from tests.fakes.apifleet import FleetApiDouble
from tests.fakes.apiserver import write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.fleetnodes import fleet


async def main(nodes: int, rounds: int) -> None:
    api = FleetApiDouble(FakeClock())
    api.put_nodes(fleet(nodes)[0])
    await api.start()
    kubeconfig = write_kubeconfig(Path(tempfile.mkdtemp(prefix="fleet")) / "kubeconfig", api.url)
    walls: list[float] = []
    try:
        for _ in range(rounds):
            before = len(api.requests)
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "fleet", "--json", "--kubeconfig", str(kubeconfig),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            walls.append(time.monotonic() - started)
            if proc.returncode != 0:
                raise SystemExit(f"fleet exited {proc.returncode}: {err.decode()[:300]}")
            seen = json.loads(out)["summary"]["nodes"]
            lists = len(api.requests) - before
        print(f"{nodes} nodes ({seen} reported): {lists} LISTs, {len(api.writes())} writes")
        print(f"wall per run: min {min(walls):.2f} s, median {sorted(walls)[len(walls) // 2]:.2f} s, "
              f"max {max(walls):.2f} s over {rounds} runs")
    finally:
        await api.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=7500)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    asyncio.run(main(options.nodes, options.rounds))
