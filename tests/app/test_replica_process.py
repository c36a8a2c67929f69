"""A real `gpu-node-agent run` serving the largest time-sliced offer (issue 37, item 1): 1024 replicas of each of
the MIG node's 28 1g.10gb devices. 25,088 asked did not answer within 60 s, and SIGTERM waited ~20 s for the
call; now big calls answer in < 0.5 s, the NIC plugin meanwhile too, and SIGTERM during one ends the process
within 5 s."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

import grpc

from agent.deviceplugin.pools import socket_name
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.app.agentproc import AgentProcess
from tests.fakes.polling import until

MIG = "nvidia.com/mig-1g.10gb"
RDMA = "gpunodeagent.io/sriov_rdma"
BOUND_S = 0.5


async def _offer(directory: Path, resource: str) -> tuple[grpc.aio.Channel, api_pb2_grpc.DevicePluginStub, list[str]]:
    """A channel to the resource's plugin socket, its stub and the device IDs of its first list."""
    channel = grpc.aio.insecure_channel(f"unix://{directory / socket_name(resource)}",
                                        options=[("grpc.max_receive_message_length", 16 << 20)])
    stub = api_pb2_grpc.DevicePluginStub(channel)
    call = stub.ListAndWatch(api_pb2.Empty())
    devices = [d.ID for d in (await asyncio.wait_for(call.read(), 30)).devices]
    call.cancel()
    return channel, stub, devices


def _request(available: list[str], size: int) -> api_pb2.PreferredAllocationRequest:
    return api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, allocation_size=size)])


async def test_big_replica_offers_answer_at_once_and_sigterm_ends_the_agent_during_one() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    nvidia = directory / "nvidia-dp.yaml"
    nvidia.write_text("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                      "    - name: mig-1g.10gb\n      replicas: 1024\n")
    agent = AgentProcess(directory, "--nvidia-dp-config", str(nvidia), profile="dgx-h100-mig")
    channels: list[grpc.aio.Channel] = []
    try:
        await until(lambda: all((directory / socket_name(r)).exists() for r in (MIG, RDMA))
                    or agent.process.poll() is not None, "the MIG and NIC plugin sockets", timeout=60)
        assert agent.process.poll() is None, agent.log_tail()
        mig_channel, mig, replicas = await _offer(directory, MIG)
        nic_channel, nic, vfs = await _offer(directory, RDMA)
        channels += [mig_channel, nic_channel]
        assert len(replicas) == 28 * 1024

        async def big(size: int) -> float:
            started = time.monotonic()
            reply = await mig.GetPreferredAllocation(_request(replicas, size), timeout=60)
            assert len(set(reply.container_responses[0].deviceIDs)) == size
            return time.monotonic() - started

        async def nic_call() -> float:
            await asyncio.sleep(0.02)  # sent while the big call is in the agent
            started = time.monotonic()
            reply = await nic.GetPreferredAllocation(_request(vfs, 1), timeout=60)
            assert len(reply.container_responses[0].deviceIDs) == 1
            return time.monotonic() - started

        for size in (1000, 25_088):
            took, nic_took = await asyncio.gather(big(size), nic_call())
            assert took < BOUND_S and nic_took < BOUND_S, (size, took, nic_took, agent.log_tail())

        in_flight = asyncio.ensure_future(mig.GetPreferredAllocation(_request(replicas, 25_088), timeout=60))
        await asyncio.sleep(0.02)
        agent.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        while agent.process.poll() is None and time.monotonic() - started < 5:
            await asyncio.sleep(0.05)
        assert agent.process.poll() is not None, f"still running 5 s after SIGTERM\n{agent.log_tail()}"
        await asyncio.gather(in_flight, return_exceptions=True)
    finally:
        for channel in channels:
            await channel.close()
        agent.stop()
