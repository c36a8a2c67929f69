"""Finding the container under admission from PodResources `List` plus pod specs (podresources.md §5)."""

from __future__ import annotations

from agent.host.podresources import ContainerDevices
from agent.kube.model import PodView
from agent.ownership.admitted import admitted_container
from agent.ownership.book import Holder, Ownership
from tests.fakes.apiserver import container_spec

GPU, NIC, ETH = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma", "gpunodeagent.io/eth"


def pod(name: str, *containers: dict, init: list[dict] | None = None) -> PodView:
    spec = {"containers": list(containers), "initContainers": init or []}
    return PodView.from_dict({"metadata": {"namespace": "ml", "name": name, "uid": f"u-{name}"}, "spec": spec})


def listed(pod_name: str, container: str, **devices: list[str]) -> ContainerDevices:
    names = {"gpu": GPU, "nic": NIC, "eth": ETH}
    return ContainerDevices("ml", pod_name, container, {names[k]: frozenset(v) for k, v in devices.items()})


def lookup(*pods: PodView):
    by_key = {p.key: p for p in pods}
    return lambda ns, name: by_key.get((ns, name))


def test_gpu_first_nic_call_sees_the_containers_gpus() -> None:
    specs = lookup(pod("old", container_spec("main", {GPU: 1, NIC: 1})),
                   pod("new", container_spec("main", {GPU: 2, NIC: 2})))
    containers = [listed("old", "main", gpu=["GPU-1"], nic=["0000:1a:00.2"]),
                  listed("new", "main", gpu=["GPU-2", "GPU-3"])]
    found = admitted_container(containers, NIC, [GPU], specs)
    assert found is not None and (found.pod, found.container) == ("new", "main")
    assert found.partner_ids == {"GPU-2", "GPU-3"}


def test_nic_first_is_an_exact_no_partner_yet() -> None:
    specs = lookup(pod("new", container_spec("main", {GPU: 1, NIC: 1})))
    found = admitted_container([listed("new", "main")], NIC, [GPU], specs)
    assert found is not None and found.partner_ids == frozenset()


def test_gpu_only_pod_is_never_paired_with_the_next_nic_container() -> None:
    # a GPU-only pod admitted just before: it holds GPUs and no NIC, but its spec asks for no NIC
    specs = lookup(pod("gpu-only", container_spec("main", {GPU: 1})), pod("nic-only", container_spec("main", {NIC: 1})))
    containers = [listed("gpu-only", "main", gpu=["GPU-1"]), listed("nic-only", "main")]
    found = admitted_container(containers, NIC, [GPU], specs)
    assert found is not None and found.pod == "nic-only" and found.partner_ids == frozenset()


def test_second_container_of_a_pod_is_told_apart_from_the_first() -> None:
    specs = lookup(pod("p", container_spec("a", {GPU: 1, NIC: 1}), container_spec("b", {GPU: 1, NIC: 1})))
    during_a = [listed("p", "a", gpu=["GPU-1"]), listed("p", "b")]
    found = admitted_container(during_a, NIC, [GPU], specs)
    assert found is not None and found.container == "a" and found.partner_ids == {"GPU-1"}
    during_b = [listed("p", "a", gpu=["GPU-1"], nic=["0000:1a:00.2"]), listed("p", "b", gpu=["GPU-2"])]
    found = admitted_container(during_b, NIC, [GPU], specs)
    assert found is not None and found.container == "b" and found.partner_ids == {"GPU-2"}


def test_a_sidecar_init_container_is_listed_and_found_an_ordinary_init_container_is_not() -> None:
    sidecar = container_spec("proxy", {NIC: 1}, restartPolicy="Always")
    ordinary = container_spec("setup", {GPU: 1, NIC: 1})
    specs = lookup(pod("p", container_spec("main", {GPU: 1}), init=[sidecar, ordinary]))
    found = admitted_container([listed("p", "proxy"), listed("p", "main", gpu=["GPU-1"])], NIC, [GPU], specs)
    assert found is not None and found.container == "proxy"


def test_several_partner_resources_count_together() -> None:
    specs = lookup(pod("p", container_spec("main", {GPU: 1, NIC: 1, ETH: 1})))
    found = admitted_container([listed("p", "main", nic=["0000:1a:00.2"], eth=["0000:c1:00.1"])], GPU, [NIC, ETH],
                               specs)
    assert found is not None and found.partner_devices == {NIC: {"0000:1a:00.2"}, ETH: {"0000:c1:00.1"}}


def test_unknown_without_specs_or_when_ambiguous() -> None:
    assert admitted_container([listed("p", "main", gpu=["GPU-1"])], NIC, [GPU], lookup()) is None
    specs = lookup(pod("a", container_spec("main", {GPU: 1, NIC: 1})),
                   pod("b", container_spec("main", {GPU: 1, NIC: 1})))
    both = [listed("a", "main", gpu=["GPU-1"]), listed("b", "main", gpu=["GPU-2"])]
    assert admitted_container(both, NIC, [GPU], specs) is None


def test_ownership_book_holders_free_and_shared_replicas() -> None:
    book = Ownership((listed("p", "main", gpu=["GPU-1::0"], nic=["0000:1a:00.2"]),
                      listed("q", "main", gpu=["GPU-1::1"])),
                     {GPU: frozenset({"GPU-1::0", "GPU-1::1", "GPU-2::0"}), NIC: frozenset({"0000:1a:00.2"})})
    assert book.holders("GPU-1") == (Holder("ml", "p", "main", GPU), Holder("ml", "q", "main", GPU))
    assert book.free(GPU) == {"GPU-2::0"}
    assert book.free(NIC) == frozenset()
    assert book.free(ETH) is None
