"""The v1beta1 `DevicePlugin` servicer for one resource: what the kubelet talks to after Register.

It holds the resource's current pool and reads device health from its one owner (`agent.signals.DeviceHealth`,
written by the health subsystem; `health_changed` says when to send a new list). ListAndWatch streams the full
device list at start and again after every change (health flip, rescan); any number of streams may be open.
Allocate answers from the pool in memory. GetPreferredAllocation must never fail admission, so it answers bad
input with no preference; it never prefers a device marked Unhealthy (the kubelet's view may lag by one
ListAndWatch message). For that it only decodes, calls the policy, counts and encodes: the validation, the
choice and the reason live in `agent.placement`. The policy is pluggable: a standalone servicer uses
`simple_policy`; the manager plugs in the PCIe-aware `placement.joint.JointAllocator`, shared by all its
resources, and its Allocate hook. With a `partner_lookup` (the kubelet's PodResources facts,
`agent.ownership`), each preference call first asks what the kubelet's records say of this container's devices
of the other kind (a `placement.policy.Partner` value, handed to the policy with the request); the lookup bounds
itself with a short deadline and says when it cannot tell in time, and then the policy guesses as before. What
the policy decided (`Preference.decision`) is kept until this resource's next Allocate, which hands it back to
the hook, or its next preference call, which replaces it (with none when that call decided nothing: invalid, or
the policy failed); the hook checks that it is still that container's (see `placement.joint`).

A big offer (time-sliced replicas: up to 28,672 IDs), or any offer beside big pools (a NIC's choice reads the
GPUs' replicas), is read and chosen in a worker thread, so that no preference call holds the event loop (every
plugin, health, DRA, remediation) for more than a few ms: what is left on the loop is gRPC's decoding and
encoding and the reply's IDs. A small one beside small pools, the common case, is chosen inline as before.
A big pool's ListAndWatch list (over 2,048 devices: 28,672 replicas take ~90 ms) is built in a worker thread
from a snapshot of the pool and its Unhealthy IDs taken on the loop.
The policy's state is shared by the manager's servicers, so every policy call and every Allocate hook holds one
lock (`policy_lock`, shared by the manager); a call that waits for it waits at most one big choice (~0.1 s),
never the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

import grpc

from agent.deviceplugin.devinfo import DeviceInfoError, DeviceInfoWriter
from agent.deviceplugin.metrics import POLICY_ERROR, AllocationMetrics
from agent.deviceplugin.payload import AllocateOptions, Contributor, build_container_payload
from agent.deviceplugin.pools import ResourcePool
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.placement.policy import (
    AllocationLevel,
    ContainerRequest,
    Decision,
    Partner,
    Preference,
    Reason,
    simple_preference,
)
from agent.signals import DeviceHealth, DeviceHealthEvent

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# (pool, one container request) -> the preference and its reason
PreferencePolicy = Callable[[ResourcePool, ContainerRequest], Preference]
# (pool, device IDs, the decision of this resource's last preference call) after each successful Allocate of one
# container request -> allocations to count by level
AllocationHook = Callable[[ResourcePool, Sequence[str], Decision | None], Iterable[AllocationLevel]]
# (pool) during a preference call -> the kubelet's facts about the container under admission; None: none to give
PartnerLookup = Callable[[ResourcePool], Awaitable[Partner | None]]

# IDs in one container request and the pools the policy reads, above which the policy runs in a worker thread:
# 2,048 offered replicas are chosen inline in ~3 ms; 28,672 (1024 replicas of 28 MIG devices) take ~60 ms, and a
# NIC's choice beside them ~30 ms (it counts the GPUs' free replicas): too long to hold the event loop
OFFLOAD_IDS = 2048


def simple_policy(pool: ResourcePool, request: ContainerRequest) -> Preference:
    """`must_include` first, then available devices in pool order (VFs of one PF together) up to the size."""
    return simple_preference(request)



def _asked(pool: ResourcePool, container: api_pb2.ContainerPreferredAllocationRequest, unhealthy: frozenset[str],
           partner: Partner | None) -> ContainerRequest:
    """One container request as the policy reads it."""
    return ContainerRequest(
        served=pool.ids, available=tuple(container.available_deviceIDs),
        must_include=tuple(container.must_include_deviceIDs), size=container.allocation_size,
        unhealthy=unhealthy, partner=partner)


ECHO_IDS = 8  # device IDs quoted back in an error or a log line
ECHO_ID_CHARS = 80


def echo_ids(ids: list[str]) -> str:
    """IDs for a message: the first few, each cut short, and how many more; a request of 100,000 bogus IDs
    must not become a 100,000-ID error reply and log line."""
    shown = ", ".join(repr(i[:ECHO_ID_CHARS]) if len(i) > ECHO_ID_CHARS else i for i in ids[:ECHO_IDS])
    return shown + (f" and {len(ids) - ECHO_IDS} more" if len(ids) > ECHO_IDS else "")

def _list_response(pool: ResourcePool, unhealthy: frozenset[str]) -> api_pb2.ListAndWatchResponse:
    """Every device of the pool with its health and NUMA node when known. It reads only its arguments, so that a
    big list can be built in a worker thread; each device is added in place (a list of messages handed to the
    response would be copied into it again)."""
    response = api_pb2.ListAndWatchResponse()
    add = response.devices.add
    numa = not pool.exclude_topology
    for device in pool.devices:
        message = add(ID=device.id, health=UNHEALTHY if device.id in unhealthy else HEALTHY)
        if numa and device.numa is not None:
            message.topology.nodes.add(ID=device.numa)
    return response


class DevicePlugin(api_pb2_grpc.DevicePluginServicer):
    """Servicer for one resource. Mutate it only from the event loop that serves it."""

    def __init__(self, pool: ResourcePool, options: AllocateOptions | None = None,
                 policy: PreferencePolicy | None = None,
                 contributors: Sequence[Contributor] | None = None, *,
                 on_allocate: AllocationHook | None = None,
                 metrics: AllocationMetrics | None = None,
                 device_info: DeviceInfoWriter | None = None, device_health: DeviceHealth | None = None,
                 partner_lookup: PartnerLookup | None = None, policy_lock: asyncio.Lock | None = None,
                 policy_reads: Callable[[], int] | None = None) -> None:
        self._pool = pool
        # how many served IDs the policy may read besides the request's: a shared policy reads every pool of the
        # manager (a NIC's preference counts the free replicas of the GPUs), so a small offer is no small choice
        self._policy_reads = policy_reads
        # held by every policy call and Allocate hook: the manager's servicers share one (and one policy state)
        self._policy_lock = policy_lock if policy_lock is not None else asyncio.Lock()
        self.partner_lookup = partner_lookup
        self._device_info = device_info
        self._device_health = device_health if device_health is not None else DeviceHealth()
        self._options = options or AllocateOptions()
        self._policy = policy or simple_policy
        self._contributors = contributors
        self._on_allocate = on_allocate
        self._decision: Decision | None = None  # the last preference's, for the next Allocate's hook
        self._metrics = metrics
        self._changed = asyncio.Event()
        self._epoch = 0  # bumped by end_streams(); streams of an older epoch return
        self._accepting = True  # False between end_streams() and accept_streams()

    @property
    def pool(self) -> ResourcePool:
        """The pool currently served."""
        return self._pool

    @property
    def device_health(self) -> DeviceHealth:
        """The owner of device health this servicer reads."""
        return self._device_health

    @property
    def resource_name(self) -> str:
        """Full resource name."""
        return self._pool.resource_name

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def update_pool(self, pool: ResourcePool, devices_changed: bool | None = None) -> bool:
        """Serve a rescanned pool; streams get a new list when devices changed. Returns whether they did.
        `devices_changed`: whether `pool.devices` differ from the served pool's, when the caller compared them
        already (off the loop: 28,672 replicas take ~10 ms to compare)."""
        if devices_changed is None:
            devices_changed = pool.devices != self._pool.devices
        changed = devices_changed or pool.exclude_topology != self._pool.exclude_topology
        self._pool = pool
        if changed:
            self._notify()
        return changed

    def health_changed(self, flips: Sequence[DeviceHealthEvent] | None) -> bool:
        """Devices flipped in the health owner (None: some did, which is unknown); streams get a new list when one
        of them is served here. Returns whether one was."""
        mine = None if flips is None else [e for e in flips if self._pool.serves_physical(e.device_id)]
        if mine is not None and not mine:
            return False
        for event in mine or ():
            log.info("%s: device %s is now %s%s", self.resource_name, event.device_id,
                     HEALTHY if event.healthy else UNHEALTHY, f" ({event.reason})" if event.reason else "")
        self._notify()
        return True

    def health(self, device_id: str) -> str:
        """`Healthy` or `Unhealthy` (a replica is as healthy as the GPU it shares)."""
        device = self._pool.device(device_id)
        healthy = self._device_health.is_healthy(device.physical_id if device is not None else device_id)
        return HEALTHY if healthy else UNHEALTHY

    def healthy_ids(self) -> frozenset[str]:
        """IDs of the pool's devices not marked Unhealthy."""
        return frozenset(d.id for d in self._pool.devices if self._device_health.is_healthy(d.physical_id))

    def _unhealthy_ids(self) -> frozenset[str]:
        """IDs of the pool's devices marked Unhealthy (all replicas of an Unhealthy GPU), from the health owner's
        few Unhealthy devices rather than a pass over the pool."""
        return self._pool.ids_of(self._device_health.unhealthy())

    def device_list(self) -> list[api_pb2.Device]:
        """The full list ListAndWatch sends: every device with its health and NUMA node when known."""
        return list(_list_response(self._pool, self._unhealthy_ids()).devices)

    def end_streams(self) -> None:
        """Make every open ListAndWatch stream return, and new ones return at once, until accept_streams().

        Called before the server stops, so that neither an open stream nor one that arrives during the stop
        holds the stop up for its whole grace period.
        """
        self._accepting = False
        self._epoch += 1
        self._notify()

    def accept_streams(self) -> None:
        """Serve ListAndWatch streams again (the server was re-started)."""
        self._accepting = True

    async def GetDevicePluginOptions(self, request: api_pb2.Empty,
                                     context: grpc.aio.ServicerContext) -> api_pb2.DevicePluginOptions:
        """Preferred allocation is available; PreStartContainer is not needed."""
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: api_pb2.Empty,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        """Full list now, then again after each change, until the stream is ended or cancelled."""
        epoch = self._epoch
        log.debug("%s: ListAndWatch stream opened", self.resource_name)
        try:
            while self._accepting and epoch == self._epoch:
                changed = self._changed  # taken before the snapshot, so no change is missed
                pool, unhealthy = self._pool, self._unhealthy_ids()
                if len(pool.devices) <= OFFLOAD_IDS:
                    yield _list_response(pool, unhealthy)
                else:  # 28,672 replicas: ~90 ms of messages, built beside the loop from the snapshot
                    response = await asyncio.to_thread(_list_response, pool, unhealthy)
                    if not (self._accepting and epoch == self._epoch):
                        return
                    yield response
                await changed.wait()
        finally:
            log.debug("%s: ListAndWatch stream closed", self.resource_name)

    def _failed(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.no_preference(self.resource_name, reason)

    def _count(self, levels: Iterable[AllocationLevel]) -> None:
        if self._metrics is not None:
            for resource, level in levels:
                self._metrics.allocated(resource, level)

    async def GetPreferredAllocation(
            self, request: api_pb2.PreferredAllocationRequest,
            context: grpc.aio.ServicerContext) -> api_pb2.PreferredAllocationResponse:
        """One preference per container; never an error, which would fail the pod's admission."""
        response = api_pb2.PreferredAllocationResponse()
        partner = await self._partner() if len(request.container_requests) == 1 else None
        unhealthy = self._unhealthy_ids()
        for container in request.container_requests:
            self._decision = None  # a call that decides nothing (invalid, failed) leaves none for the Allocate
            try:
                preference = await self._choose(container, unhealthy, partner)
            except Exception:
                log.exception("%s: GetPreferredAllocation policy failed; no preference", self.resource_name)
                self._failed(POLICY_ERROR)
                return api_pb2.PreferredAllocationResponse()
            self._count(preference.levels)
            self._decision = preference.decision
            if preference.reason is not Reason.OK:
                log.warning("%s: GetPreferredAllocation: %s: %s", self.resource_name, preference.reason.value,
                            preference.detail)
                self._failed(preference.reason.value)
            if preference.reason is Reason.INVALID_REQUEST:
                return api_pb2.PreferredAllocationResponse()
            response.container_responses.add(deviceIDs=preference.devices)
        return response

    async def _choose(self, container: api_pb2.ContainerPreferredAllocationRequest, unhealthy: frozenset[str],
                      partner: Partner | None) -> Preference:
        """The policy's answer: inline for a small request, in a worker thread for a big one (see the module
        docstring); either way under the policy lock. A big request is also read in the thread: copying its IDs
        out of the message and the pool's IDs (built at the first call) cost as much as a choice did."""
        pool = self._pool
        lock = self._policy_lock
        await lock.acquire()
        # len() of a repeated field is O(1); no request is read on the loop in proportion to its size
        reads = len(container.available_deviceIDs) + len(container.must_include_deviceIDs)
        if reads + (self._policy_reads() if self._policy_reads is not None else len(pool.devices)) <= OFFLOAD_IDS:
            try:
                return self._policy(pool, _asked(pool, container, unhealthy, partner))
            finally:
                lock.release()

        def choose() -> Preference:
            return self._policy(pool, _asked(pool, container, unhealthy, partner))

        try:
            chosen = asyncio.get_running_loop().run_in_executor(None, choose)
        except BaseException:
            lock.release()
            raise

        def done(future: asyncio.Future[Preference]) -> None:
            # released when the thread is done, not when this call is: a call the kubelet cancels must not let
            # the next policy call run beside its thread
            lock.release()
            if not future.cancelled():
                future.exception()  # retrieved here too, so a cancelled call's failure is not logged as lost

        chosen.add_done_callback(done)
        return await asyncio.shield(chosen)

    async def _partner(self) -> Partner | None:
        """The kubelet's fact for this call, or None (no lookup, or it failed: never fail the preference)."""
        if self.partner_lookup is None:
            return None
        try:
            return await self.partner_lookup(self._pool)
        except Exception:
            log.exception("%s: partner lookup failed; the policy guesses", self.resource_name)
            return None

    async def Allocate(self, request: api_pb2.AllocateRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.AllocateResponse:
        """Payload per container request; INVALID_ARGUMENT naming any device this resource does not have."""
        response = api_pb2.AllocateResponse()
        for container in request.container_requests:
            ids = list(dict.fromkeys(container.devices_ids))  # a device named twice is one device
            devices = [self._pool.device(device_id) for device_id in ids]
            unknown = [device_id for device_id, device in zip(ids, devices, strict=True) if device is None]
            if unknown:
                message = f"{self.resource_name}: unknown device IDs: {echo_ids(unknown)}"
                log.warning("Allocate refused: %s", message)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            found = [device for device in devices if device is not None]
            if self._pool.fail_requests_greater_than_one and len(ids) > 1 and \
                    any(device.replica is not None for device in found):  # NVIDIA's ValidateRequest, its words
                message = (f"invalid allocation request for {self.resource_name!r}: invalid request: maximum "
                           f"request size for shared resources is 1; found {len(ids)}")
                log.warning("Allocate refused: %s", message)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            sick = [device.id for device in found if not self._device_health.is_healthy(device.physical_id)]
            if sick:
                log.warning("%s: allocating unhealthy devices %s", self.resource_name, echo_ids(sick))
            payload = build_container_payload(self._pool, found, self._options, self._contributors)
            if self._device_info is not None:
                try:
                    self._device_info.write(self._pool, found)
                except DeviceInfoError as exc:  # as SR-IOV DP: the CNI would miss the device's info
                    log.error("%s: Allocate failed: %s", self.resource_name, exc)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{self.resource_name}: {exc}")
            response.container_responses.append(payload.to_proto())
            log.info("%s: allocated %s", self.resource_name, echo_ids(ids))
            decision, self._decision = self._decision, None  # one Allocate takes it, whoever it is for
            if self._on_allocate is not None:
                try:
                    async with self._policy_lock:  # never beside a preference chosen in a worker thread
                        self._count(self._on_allocate(self._pool, ids, decision))
                except Exception:  # bookkeeping must never fail an Allocate
                    log.exception("%s: allocation hook failed", self.resource_name)
        return response

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest,
                                context: grpc.aio.ServicerContext) -> api_pb2.PreStartContainerResponse:
        """Not required (the options say so); answers empty."""
        return api_pb2.PreStartContainerResponse()
