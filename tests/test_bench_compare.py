"""bench/compare.py (issue 32): the Performance table (docs/performance.md since issue 38) is read whole, every
command in it names a bench that exists, and a bench run through it comes back beside the documented figure; a
bench that fails makes it fail."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "bench" / "compare.py"
TABLE = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")


def load_compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_compare", COMPARE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


compare = load_compare()


def table_lines(text: str) -> list[str]:
    """The table rows of a file whose only table is the Performance table."""
    return [line for line in text.splitlines() if line.startswith("|")]


def run_compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(COMPARE), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)


def test_every_row_of_the_table_is_read_and_each_command_names_an_existing_bench() -> None:
    rows = compare.performance_rows(TABLE)
    assert len(rows) == len(table_lines(TABLE)) - 2 >= 20
    for row in rows:
        assert row.goal and row.figure, row
        assert row.commands, f"row {row.index} ({row.goal[:60]}) has no `python bench/...` command"
        for command in row.commands:
            assert (ROOT / command.script).is_file(), f"row {row.index} runs missing {command.script}"
    first = next(row for row in rows if row.goal.startswith("GetPreferredAllocation p99"))
    assert first.goal.startswith("GetPreferredAllocation p99") and first.figure.startswith("dgx-h100: p50")
    assert [str(command) for command in first.commands] == ["python bench/allocation_latency.py"]
    grpc = next(row for row in rows if "grpc.aio (as served)" in row.goal)
    assert [c.args for c in grpc.commands] == [("--rounds", "5"), ("--rounds", "1", "--calls", "200", "--idle", "30")]
    mig = next(row for row in rows if row.goal.startswith("DRA: a 1 MIG"))
    assert [c.args for c in mig.commands] == [("--profile", "dgx-h100-mig"), ()]  # "(and without `--profile`)"
    assert set(compare.QUICK) <= {command.name for row in rows for command in row.commands}


def test_rows_without_a_bench_command_are_kept_and_listed_as_such(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n| goal | figure | command |\n|---|---|---|\n"
                      "| a | 1 ms | `python bench/allocation_latency.py --requests 10` |\n"
                      "| b | 2 ms \\| 3 ms | measured by hand on a node |\n"
                      "| c | 4 ms | same |\n"
                      "| d |\n\n## Notes\n| not | this | table |\n", encoding="utf-8")
    rows = compare.performance_rows(doc.read_text(encoding="utf-8"))
    assert [(row.goal, row.figure, len(row.commands)) for row in rows] == [
        ("a", "1 ms", 1), ("b", "2 ms | 3 ms", 0), ("c", "4 ms", 0), ("d", "", 0)]
    readme = tmp_path / "README.md"  # the table's old place: a level-2 section
    readme.write_text("# x\n\n## Performance\n\n| goal | figure | command |\n|---|---|---|\n| a | 1 ms | same |\n"
                      "\n## Limits\n| not | this | table |\n", encoding="utf-8")
    assert [row.goal for row in compare.performance_rows(readme.read_text(encoding="utf-8"))] == ["a"]
    listed = run_compare("--doc", str(doc), "--list")
    assert listed.returncode == 0, listed.stderr
    assert "python bench/allocation_latency.py --requests 10" in listed.stdout
    assert listed.stdout.count("no command") == 3
    missing = tmp_path / "none.md"
    missing.write_text("# no table\n", encoding="utf-8")
    refused = run_compare("--doc", str(missing), "--list")
    assert refused.returncode == 2 and "no '# Performance' or '## Performance' section" in refused.stderr


def test_one_bench_runs_end_to_end_beside_its_documented_figure() -> None:
    done = run_compare("--only", "allocation_latency")
    assert done.returncode == 0, done.stderr
    row = next(row for row in compare.performance_rows(TABLE) if row.goal.startswith("GetPreferredAllocation"))
    assert f"documented: {row.figure}" in done.stdout
    assert "now: python bench/allocation_latency.py  [ok," in done.stdout and "load average" in done.stdout
    # the bench's own summary rows, as it prints them: node, kind, context, calls, p50/p99/max in µs
    assert any(line.split()[:2] == ["dgx-h100", "all"] for line in done.stdout.splitlines())
    assert "1 bench runs in" in done.stdout


def test_markdown_names_a_bench_that_timed_out_and_exits_nonzero() -> None:
    done = run_compare("--only", "allocation_latency", "--markdown", "--timeout", "0.05")
    assert done.returncode == 1
    assert "failed: python bench/allocation_latency.py" in done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["| goal | documented figure | this run | command |", "|---|---|---|---|"]
    assert lines[2].startswith("| GetPreferredAllocation p99 <= 1 ms")
    assert "**failed: timed out after 0.05 s**" in lines[2]


def test_an_unknown_bench_name_is_refused_with_the_known_ones() -> None:
    done = run_compare("--only", "no_such_bench")
    assert done.returncode == 2
    assert "unknown: no_such_bench" in done.stderr and "allocation_latency" in done.stderr
