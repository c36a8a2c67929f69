"""The HTTP API double in a process of its own, for tests that time the agent's event loop: the double's own JSON
encoding (a 20,000-pod LIST is megabytes) must not run on, or take the GIL from, the process being measured.

    python -m tests.fakes.apiserver_proc --node NODE --pods N [--namespace NS] [--ignore-field-selectors] [--pad B]

Serves pods `p0`..`p<N-1>` in NS, every tenth on NODE and the rest on other nodes, plus `--own NAME` pods on NODE;
prints its URL on one line, then serves until stdin closes. `--ignore-field-selectors` answers every LIST with
all pods, as a server or proxy that drops the `fieldSelector` parameter would; `--pad B` gives each pod an
annotation of B bytes (real pods carry kilobytes of annotations and managedFields).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from tests.fakes.apiserver import ApiServerDouble, container_spec
from tests.fakes.clock import FakeClock


async def serve(args: argparse.Namespace) -> None:
    api = ApiServerDouble(FakeClock(), args.node)
    if args.ignore_field_selectors:
        def selects_all(selector: str, obj: dict[str, Any]) -> bool:
            return True

        api._selects = selects_all  # type: ignore[method-assign]
    for i in range(args.pods):
        api.add_pod(args.namespace, f"p{i}", node=args.node if i % 10 == 0 else f"other-{i % 7}",
                    containers=[container_spec("main", {"nvidia.com/gpu": 1})],
                    annotations={"pad": "x" * args.pad} if args.pad else None, ips=(f"10.{i >> 16 & 255}."
                                                                                     f"{i >> 8 & 255}.{i & 255}",))
    for name in args.own:
        api.add_pod(args.namespace, name, containers=[container_spec("main", {"nvidia.com/gpu": 1})])
    print(await api.start(), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await api.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", required=True)
    parser.add_argument("--pods", type=int, default=0)
    parser.add_argument("--namespace", default="team")
    parser.add_argument("--own", action="append", default=[])
    parser.add_argument("--ignore-field-selectors", action="store_true")
    parser.add_argument("--pad", type=int, default=0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
