"""`preferred_replicas` against NVIDIA's `greedyAlloc` written the slow, obvious way (one replica at a time, the
minimum over every offered replica): the heap must give the same answer for every input (issue 37, item 1)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.placement.replicas import DISTRIBUTED, PACKED, preferred_replicas


def greedy(served: list[str], offered: list[str], must_include: list[str], size: int, *, policy: str,
           rank: Callable[[str], int] | None) -> list[str]:
    must = list(dict.fromkeys(must_include))
    candidates = sorted(set(offered) - set(must))
    if size - len(must) < 0 or len(candidates) < size - len(must):
        return []
    gpu_of = {c: c.partition("::")[0] for c in candidates}
    available = Counter(gpu_of.values())
    total = Counter(s.partition("::")[0] for s in served if s.partition("::")[0] in available)
    picked: Counter[str] = Counter()
    sign = -1 if policy == PACKED else 1
    chosen: list[str] = []
    for _ in range(size - len(must)):
        best = min(candidates, key=lambda c: (rank(gpu_of[c]) if rank else 0,
                                               sign * (total[gpu_of[c]] - available[gpu_of[c]]),
                                               picked[gpu_of[c]], c))
        picked[gpu_of[best]] += 1
        available[gpu_of[best]] -= 1
        chosen.append(best)
        candidates.remove(best)
    return must + chosen


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[str], list[str], list[str], int, str, dict[str, int] | None]:
    gpus = draw(st.lists(st.sampled_from([f"GPU-{i}" for i in range(8)]), min_size=1, max_size=6, unique=True))
    replicas = draw(st.integers(1, 12))
    served = [f"{g}::{n}" for g in gpus for n in range(replicas)] + draw(st.sampled_from([[], ["MIG-x"]]))
    offered = draw(st.lists(st.sampled_from([*served, "stray::1"]), max_size=len(served) + 2))
    must = draw(st.lists(st.sampled_from(offered), max_size=2)) if offered else []
    ranks = draw(st.one_of(st.none(), st.dictionaries(st.sampled_from([*gpus, "stray", "MIG-x"]), st.integers(0, 2))))
    return served, offered, must, draw(st.integers(0, len(offered) + 1)), \
        draw(st.sampled_from([DISTRIBUTED, PACKED])), ranks


@settings(max_examples=300, deadline=None)
@given(requests())
def test_the_heap_chooses_as_nvidias_greedy_loop(case: tuple[list[str], list[str], list[str], int, str,
                                                             dict[str, int] | None]) -> None:
    served, offered, must, size, policy, ranks = case
    rank = (lambda gpu: ranks.get(gpu, 3)) if ranks is not None else None
    assert preferred_replicas(served, offered, must, size, policy=policy, rank=rank) == \
        greedy(served, offered, must, size, policy=policy, rank=rank)
