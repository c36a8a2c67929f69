"""Re-run the benches behind the Performance table (docs/performance.md) and print each row's figure beside the
new output.

Issue 32 wants every figure in that table re-measurable with its command, and the old and new figures side by
side. This reads the table under the `# Performance` heading of docs/performance.md (`--doc` reads another file;
`| goal | figure | command |`), takes each backticked `python bench/<script>.py ...` from the command cell (a
backticked option list beside it, such as "(and `--pods 100`)", is the same script run with those options alone;
a cell that says "same" repeats the row above), runs the chosen commands once each and prints, per row: the goal,
the documented figure and the summary lines of the new run. The benches' own output is not parsed: a figure
means what the bench prints beside it.

    python bench/compare.py --list                     # rows, their commands
    python bench/compare.py --quick                    # the fast benches that need no root (QUICK below)
    python bench/compare.py --only dcgm_scrape dra_prepare [--markdown] [--timeout 900]

Each command runs as `sys.executable bench/<script>.py ...` in the repository root, with the root first on
PYTHONPATH so the checkout being measured is the one imported (an editable install may point elsewhere).
Exit status 1 when any bench failed or timed out (named on stderr), 2 for a bad selection.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "performance.md"
# Timed once each (the table's commands, 2-core VM, load average 0.8-1.5): 2-21 s, allocation_grpc and
# podresources_pairing the longest; none needs root or a network namespace. Left out: startup (35 s), grpc_server
# and footprint (minutes), podresources_lookup (2 loads x 2,000 lookups), and the netns benches, which need root:
# link_watch_idle, netacct_forwarding, netacct_scrape, shaping.
QUICK = ("allocation_latency", "allocation_grpc", "replica_preference", "gpu_state_pass", "nic_counter_pass",
         "nvml_suspend", "dcgm_scrape", "dra_prepare", "health_latency", "http_idle", "podresources_pairing")
BENCH_COMMAND = re.compile(r"^python\s+(bench/[\w-]+\.py)\b(.*)$")
FIGURE_LINE = re.compile(r"p50|p90|p99|median|max|\bms\b|µs|\bus\b|kpps|Gbit|Mbit|MB|%|load average")
CELL_SPLIT = re.compile(r"(?<!\\)\|")
PERFORMANCE_HEADING = re.compile(r"^#{1,2} Performance[ \t]*$", re.MULTILINE)
NEXT_HEADING = re.compile(r"^#{1,6} ", re.MULTILINE)


@dataclass(frozen=True)
class Command:
    """One bench invocation: the script's path relative to the repository root and its arguments."""

    script: str
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        return Path(self.script).stem

    def __str__(self) -> str:
        return shlex.join(["python", self.script, *self.args])


@dataclass
class Row:
    index: int
    goal: str
    figure: str
    commands: list[Command] = field(default_factory=list)


@dataclass
class Result:
    command: Command
    seconds: float
    load_before: float
    load_after: float
    lines: list[str]
    failure: str | None  # why the bench failed; None when it exited 0


def performance_rows(text: str) -> list[Row]:
    """The rows of the table under the `# Performance` (or `## Performance`) heading, up to the next heading, in
    order; a row without a bench command has no commands."""
    heading = PERFORMANCE_HEADING.search(text)
    if heading is None:
        raise ValueError("no '# Performance' or '## Performance' section")
    end = NEXT_HEADING.search(text, heading.end())
    section = text[heading.end():end.start() if end else len(text)]
    table = [line.strip() for line in section.splitlines() if line.strip().startswith("|")]
    rows: list[Row] = []
    for line in table[2:]:  # header and separator
        cells = [cell.strip().replace("\\|", "|") for cell in CELL_SPLIT.split(line.strip().strip("|"))]
        if len(cells) < 3:
            rows.append(Row(len(rows), cells[0] if cells else "", "", []))
            continue
        commands = cell_commands(cells[-1])
        if not commands and cells[-1].lower().startswith("same") and rows:
            commands = list(rows[-1].commands)
        rows.append(Row(len(rows), cells[0], " | ".join(cells[1:-1]), commands))
    return rows


def cell_commands(cell: str) -> list[Command]:
    """Every backticked bench command in a command cell. A backticked option list reruns the previous script with
    those options alone; "without `--opt`" reruns the previous command minus that option and its values."""
    commands: list[Command] = []
    for span in re.finditer(r"`([^`]+)`", cell):
        try:
            words = shlex.split(span.group(1))
        except ValueError:
            continue
        match = BENCH_COMMAND.match(span.group(1).strip())
        if match:
            commands.append(Command(match.group(1), tuple(words[2:])))
        elif words and words[0].startswith("--") and commands:
            previous = commands[-1]
            if cell[: span.start()].rstrip().endswith("without"):
                commands.append(Command(previous.script, without_options(previous.args, set(words))))
            else:
                commands.append(Command(previous.script, tuple(words)))
    return list(dict.fromkeys(commands))


def without_options(args: tuple[str, ...], dropped: set[str]) -> tuple[str, ...]:
    kept: list[str] = []
    dropping = False
    for word in args:
        if word.startswith("--"):
            dropping = word.split("=", 1)[0] in dropped
        if not dropping:
            kept.append(word)
    return tuple(kept)


def summary_lines(stdout: str, limit: int) -> list[str]:
    """All of a short output; of a long one, the last `limit` lines that carry a figure."""
    lines = [line.rstrip() for line in stdout.splitlines() if line.strip()]
    if len(lines) <= limit:
        return lines
    return [line for line in lines if FIGURE_LINE.search(line) and re.search(r"\d", line)][-limit:]


def run_bench(command: Command, timeout: float, limit: int) -> Result:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    load_before, started = os.getloadavg()[0], time.monotonic()
    try:
        done = subprocess.run([sys.executable, command.script, *command.args], cwd=ROOT, env=env, timeout=timeout,
                              capture_output=True, text=True, errors="replace", check=False)
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout
        return Result(command, time.monotonic() - started, load_before, os.getloadavg()[0],
                      summary_lines(stdout or "", limit), f"timed out after {timeout:g} s")
    lines = summary_lines(done.stdout, limit)
    failure = None
    if done.returncode != 0:
        failure = f"exit status {done.returncode}"
        lines += [f"stderr: {line}" for line in done.stderr.strip().splitlines()[-5:]]
    return Result(command, time.monotonic() - started, load_before, os.getloadavg()[0], lines, failure)


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def print_list(rows: list[Row]) -> None:
    for row in rows:
        commands = "; ".join(str(command) for command in row.commands) or "no command"
        print(f"{row.index:2d}  {shorten(row.goal, 70):70}  {commands}")


def print_text(rows: list[Row], results: dict[Command, Result]) -> None:
    for row in rows:
        print(f"\n[{row.index}] {row.goal}\n  documented: {row.figure}")
        for command in row.commands:
            result = results[command]
            state = f"FAILED ({result.failure})" if result.failure else "ok"
            print(f"  now: {command}  [{state}, {result.seconds:.1f} s, load average {result.load_before:.2f} → "
                  f"{result.load_after:.2f}]")
            print("\n".join(f"    {line}" for line in result.lines))


def markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def print_markdown(rows: list[Row], results: dict[Command, Result]) -> None:
    print("| goal | documented figure | this run | command |\n|---|---|---|---|")
    for row in rows:
        for command in row.commands:
            result = results[command]
            state = f"**failed: {result.failure}**<br>" if result.failure else ""
            now = state + "<br>".join(markdown_cell(line.strip()) for line in result.lines) + (
                f"<br>(load average {result.load_before:.2f} → {result.load_after:.2f}, {result.seconds:.1f} s)")
            print(f"| {markdown_cell(row.goal)} | {markdown_cell(row.figure)} | {now} | `{command}` |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--doc", "--readme", type=Path, default=TABLE,
                        help="the markdown file whose Performance table is read (default docs/performance.md)")
    parser.add_argument("--list", action="store_true", help="print the rows and their commands, run nothing")
    select = parser.add_mutually_exclusive_group()
    select.add_argument("--only", nargs="+", metavar="SCRIPT", help="bench script names to run (no .py)")
    select.add_argument("--quick", action="store_true", help=f"run {', '.join(QUICK)}")
    parser.add_argument("--markdown", action="store_true", help="print the side-by-side as a markdown table")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per bench before it counts as failed")
    parser.add_argument("--lines", type=int, default=14, help="summary lines kept per bench")
    args = parser.parse_args(argv)
    try:
        rows = performance_rows(args.doc.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"compare: cannot read the Performance table: {error}", file=sys.stderr)
        return 2
    if args.list:
        print_list(rows)
        return 0
    known = {command.name for row in rows for command in row.commands}
    wanted = set(QUICK if args.quick else args.only or ())
    if not wanted or wanted - known:
        print(f"compare: choose --quick or --only among: {' '.join(sorted(known))}"
              + (f" (unknown: {' '.join(sorted(wanted - known))})" if wanted - known else ""), file=sys.stderr)
        return 2
    chosen = [row for row in rows if any(command.name in wanted for command in row.commands)]
    for row in chosen:
        row.commands = [command for command in row.commands if command.name in wanted]
    started, results = time.monotonic(), {}
    for command in dict.fromkeys(command for row in chosen for command in row.commands):
        print(f"running {command} ...", file=sys.stderr, flush=True)
        results[command] = run_bench(command, args.timeout, args.lines)
    (print_markdown if args.markdown else print_text)(chosen, results)
    failed = [str(result.command) for result in results.values() if result.failure]
    print(f"\n{len(results)} bench runs in {time.monotonic() - started:.1f} s; load average now "
          f"{os.getloadavg()[0]:.2f}")
    if failed:
        print(f"compare: failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
