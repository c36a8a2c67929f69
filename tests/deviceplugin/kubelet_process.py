"""The stand-in kubelet in a process of its own, for tests that measure the agent's event loop: in the test's
process it would share that loop, and decoding a list of 28,672 devices is the kubelet's work, not the agent's.

`python -m tests.deviceplugin.kubelet_process DIR` serves `DIR/kubelet.sock`, prints `ready`, then one line
`<resource> <lists> <devices>` each time a plugin's ListAndWatch brings a new list, until stdin closes."""

from __future__ import annotations

import asyncio
import sys

from agent.simulate.kubelet import LocalKubelet


async def main(directory: str) -> None:
    kubelet = LocalKubelet(directory)
    await kubelet.start()
    print("ready", flush=True)
    seen: dict[str, int] = {}
    closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
    try:
        while not closed.done():
            for name, view in list(kubelet.plugins.items()):
                if seen.get(name) != view.lists:
                    seen[name] = view.lists
                    print(name, view.lists, len(view.devices), flush=True)
            await asyncio.wait([closed], timeout=0.02)
    finally:
        await kubelet.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
