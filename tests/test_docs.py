"""The docs match the agent (issues 29 and 38): every `run` flag is documented in the README, `docs/` or
deploy/configmap.yaml, the test command's optional system packages are named, the licence the package declares is
shipped, and every relative link and `#anchor` in the README and `docs/` leads somewhere (the README is the map:
each document in `docs/` is linked from it)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from agent.config import model
from agent.config.load import _flagged_fields, camel_case

ROOT = Path(__file__).resolve().parents[1]
CONFIGMAP = (ROOT / "deploy" / "configmap.yaml").read_text(encoding="utf-8")


def documents(root: Path) -> list[Path]:
    """The README and every markdown file under docs/, README first."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


DOCS = "\n".join(path.read_text(encoding="utf-8") for path in documents(ROOT))

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\([ \t]*<?([^)\s>]*)>?(?:[ \t]+\"[^\"]*\")?[ \t]*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*<?([^\s>]+)>?", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out, line for line (a link's text may run
    over a line break, so links are looked for in the whole text)."""
    lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else CODE_SPAN.sub("", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text, lower-cased, punctuation other than `-`
    and `_` dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every `#anchor` a markdown file offers: its heading slugs (a repeated one gets -1, -2, ... as on GitHub)
    and explicit `<a id=...>` / `<a name=...>` anchors."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = None if fenced else HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str


def links(path: Path) -> list[Link]:
    """Every link target in a markdown file's prose: inline links and images, and reference definitions."""
    text = prose(path.read_text(encoding="utf-8"))
    found = [(match.start(), match.group(1)) for match in INLINE_LINK.finditer(text)]
    found += [(match.start(), match.group(1)) for match in REFERENCE_DEFINITION.finditer(text)]
    return [Link(path, text.count("\n", 0, start) + 1, target) for start, target in sorted(found)]


def broken_links(root: Path) -> list[str]:
    """Each relative link in the README and docs/ that names no file of the repository, or an anchor its
    markdown target does not have, as `file:line: target (why)`."""
    root = root.resolve()
    problems: list[str] = []
    for document in documents(root):
        for link in links(document):
            if SCHEME.match(link.target) or link.target.startswith("//"):
                continue  # http(s), mailto: not ours to check offline
            where = f"{link.source.relative_to(root)}:{link.line}: {link.target}"
            path_part, _, anchor = link.target.partition("#")
            if not path_part and not anchor:
                problems.append(f"{where} (empty link)")
                continue
            target = (link.source.parent / path_part).resolve() if path_part else link.source
            if not target.is_relative_to(root):
                problems.append(f"{where} (outside the repository)")
            elif not target.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and target.suffix == ".md":
                if anchor not in anchors(target):
                    problems.append(f"{where} (no heading or anchor #{anchor} in {target.relative_to(root)})")
            elif anchor and not LINE_ANCHOR.match(anchor):
                problems.append(f"{where} (#{anchor} on a file that is not markdown)")
    return problems


def test_every_run_flag_is_documented() -> None:
    undocumented = []
    for item in _flagged_fields(model.AgentConfig):
        flag = item.field.metadata.get("flag")
        if not flag:
            continue
        dotted = ".".join(camel_case(part) for part in item.path)
        key = camel_case(item.path[-1])
        if flag in DOCS or re.search(rf"\b{key}\b", DOCS) or re.search(rf"^\s*{key}:", CONFIGMAP, re.MULTILINE):
            continue
        undocumented.append(f"{flag} ({dotted})")
    assert not undocumented, f"flags neither in README, docs/ nor deploy/configmap.yaml: {undocumented}"


def test_the_declared_licence_is_shipped() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["license"]
    assert declared == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]


def test_the_optional_system_packages_of_the_test_command_are_named() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    packages = [word for word in ci.split("--no-install-recommends", 1)[1].split(">", 1)[0].split() if word != "\\"]
    assert packages and all(f"`{package}`" in DOCS for package in packages), packages


def test_the_readme_keeps_ci_s_test_command() -> None:
    """.ci/run runs the README's test command; the two must stay word for word the same."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)
    assert f"```sh\n{command}\n```" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_relative_link_and_anchor_in_the_readme_and_docs_resolves() -> None:
    problems = broken_links(ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_links_every_document_in_docs() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / link.target.partition("#")[0]).resolve() for link in links(readme)}
    unlinked = [str(path.relative_to(ROOT)) for path in documents(ROOT)[1:] if path.resolve() not in linked]
    assert not unlinked, f"documents the README's map does not name: {unlinked}"


def test_the_link_check_finds_a_missing_file_a_missing_anchor_and_a_link_out_of_the_repository(tmp_path: Path) -> None:
    """The check itself can fail: a small tree with one good link of each kind and one broken link of each kind."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tools.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "docs" / "a.md").write_text(
        "# Node self-check: `gpu-node-agent doctor`\n\n## Time-slicing from NVIDIA's config file\n\n## Twice\n\n"
        "## Twice\n\n<a id=\"kept\"></a>\n\n```\n[not a link](nowhere.md)\n```\n\nSee `[code](nowhere.md)`, "
        "[up](../README.md#the-map), [self](#twice-1), [kept](#kept), [line](../tools.py#L1).\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# Top\n\n## The map\n\n"
        "[doctor](docs/a.md#node-self-check-gpu-node-agent-doctor) "
        "[nvidia](docs/a.md#time-slicing-from-nvidias-config-file) [web](https://example.com/x.md#y)\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#node-self-check) [out](../elsewhere.md) [two\n"
        "lines](#no-such-heading)\n"
        "[ref]: docs/a.md#nope\n", encoding="utf-8")
    assert broken_links(tmp_path) == [
        "README.md:6: docs/b.md (no such file)",
        "README.md:6: docs/a.md#node-self-check (no heading or anchor #node-self-check in docs/a.md)",
        "README.md:6: ../elsewhere.md (outside the repository)",
        "README.md:6: #no-such-heading (no heading or anchor #no-such-heading in README.md)",
        "README.md:8: docs/a.md#nope (no heading or anchor #nope in docs/a.md)",
    ]
