"""The fast path of `prom_text` gives prometheus-client's answers, or steps aside.

The reference is prometheus-client's own text parser (`text_string_to_metric_families`): for every text here the
samples (family name, labels, value) must be the same, whichever path `samples` took, and texts outside the plain
subset must leave the fast path (None) so that the reference decides, errors included.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from agent.health import prom_text
from agent.simulate.dcgm_exporter import ExporterGpu, SimulatedDcgmExporter

GPUS = [ExporterGpu(index=i, uuid=f"GPU-{i}0000000-1111-2222-3333-444444444444", bus_id=f"0000:{0x1b + i:02x}:00.0",
                    mig=(("1g.10gb", 1), ("1g.10gb", 2)) if i == 1 else ()) for i in range(3)]


def reference(text: str) -> list[prom_text.Sample]:
    return [(f.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def same(a: list[prom_text.Sample], b: list[prom_text.Sample]) -> bool:
    """Equal, NaN equal to NaN."""
    return len(a) == len(b) and all(x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
                                    for x, y in zip(a, b, strict=True))


def test_a_simulated_exporter_page_takes_the_fast_path_with_the_references_answer() -> None:
    exporter = SimulatedDcgmExporter(GPUS, xid_metrics=("gauge", "count", "total"), extra_fields=True)
    exporter.inject_xid(GPUS[0].uuid, 79)
    exporter.inject_xid(GPUS[1].uuid, 94, gpu_instance=2)
    text = exporter.render()
    fast = prom_text.fast_samples(text)
    assert fast is not None and len(fast) > 100
    assert same(fast, reference(text))


PLAIN = [
    "# HELP A_total things\n# TYPE A_total counter\nA_total{gpu=\"0\"} 5\n",  # a counter family loses _total
    "# TYPE B counter\nB{gpu=\"0\"} 1\nB_total{gpu=\"0\"} 2\n",  # B_total is not B's: an untyped family of its own
    "# TYPE C gauge\nC{x=\"a}b\",y=\"\"} 1e3\nD 4\nE{a=\"1\",} NaN\nF{ a = \"2\" } +Inf\n",
    "# HELP G help\nG 1\n# TYPE G gauge\nG 2\n",  # HELP then TYPE of the same family
    "# TYPE H summary\nH_count 3\nH_sum 4.5\nH{quantile=\"0.5\"} 1\n# TYPE I histogram\nI_bucket{le=\"1\"} 1\n"
    "I_count 1\nI_sum 0.5\nI 7\n",
    "# a comment\n\n   \nJ{} -1\n",
    "# TYPE K counter\n# TYPE K gauge\nK 1\n",  # the last TYPE wins
]

NOT_PLAIN = [
    'A{x="a\\"b"} 1\n',  # an escape in a label value
    "A 1 1700000000000\n",  # a timestamp
    'A{x="1"} 1 # {trace_id="a"} 1\n',  # an exemplar
    'A{__name__="B"} 1\n',
    'A{x="1",x="2"} 1\n',
    'A{x="1" y="2"} 1\n',
    "A 1_000\n",
    "A forty-one\n",
    "<html><body>404 page not found</body></html>\n",
    '# TYPE "quoted name" gauge\n',
    "# TYPE A\n",
    "# HELP\nA 1\n",  # HELP without a name
]


@pytest.mark.parametrize("text", PLAIN)
def test_plain_texts_take_the_fast_path_with_the_references_answer(text: str) -> None:
    fast = prom_text.fast_samples(text)
    assert fast is not None
    assert same(fast, reference(text))


@pytest.mark.parametrize("text", NOT_PLAIN)
def test_anything_else_is_left_to_the_reference(text: str) -> None:
    assert prom_text.fast_samples(text) is None
    try:
        expected = reference(text)
    except Exception as exc:  # the reference refuses it: so does `samples`, with the reference's error
        with pytest.raises(type(exc)):
            prom_text.samples(text)
    else:
        assert same(prom_text.samples(text), expected)


_names = st.sampled_from(["A", "A_total", "A_count", "A_sum", "A_bucket", "B", "B_total"])
_types = st.sampled_from(["counter", "gauge", "summary", "histogram", "untyped"])
_values = st.sampled_from(["1", "0", "-2.5", "1e3", "NaN", "+Inf", "-Inf", "7"])
_label_values = st.sampled_from(["0", "GPU-1", "a}b", "", "x y", "00000000:1B:00.0"])
_lines = st.one_of(
    st.builds(lambda n, t: f"# TYPE {n} {t}", _names, _types),
    st.builds(lambda n: f"# HELP {n} some help", _names),
    st.just("# plain comment"),
    st.just(""),
    st.builds(lambda n, v: f"{n} {v}", _names, _values),
    st.builds(lambda n, a, b, v: f'{n}{{gpu="{a}",UUID="{b}"}} {v}', _names, _label_values, _label_values, _values),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_lines, max_size=12))
def test_any_sequence_of_plain_lines_gives_the_references_families(lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    fast = prom_text.fast_samples(text)
    assert fast is not None
    assert same(fast, reference(text))
