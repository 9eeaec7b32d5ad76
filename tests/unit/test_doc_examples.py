"""Every canner TOML example in the docs loads through the real config loader.

What is checked:

- every fenced ```` ```toml ```` block in ``docs/``, ``conf/`` and ``README.md``: parsed by
  ``tomllib``, laid over a minimal base config (an issuer, one project) when it is a fragment, and
  validated by :func:`canner.config.parse_config`, which checks every delivery table by its
  sink's rules (what both daemons run at start);
- every ``conf/*.toml`` file whole, the same way, and each commented-out table in it (a
  ``# [table]`` line and the ``# key = value`` lines after it, uncommented): what an operator
  would get by uncommenting it;
- every key table (a Markdown table whose first column is headed ``key``) under a heading that
  names a config table in backticks (```[connections]```): each key in it is one the loader knows.

Two HTML comments, alone on the line before a block, mark blocks that are not loadable examples:
``<!-- counter-example -->`` (the loader must refuse it: the test checks that it does) and
``<!-- not-canner-config -->`` (TOML of another program, e.g. a ``pyproject.toml``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from canner.config import PLACEHOLDER_ISSUER, ConfigError, known_keys, parse_config

ROOT = Path(__file__).resolve().parents[2]
COUNTER = "<!-- counter-example -->"
FOREIGN = "<!-- not-canner-config -->"
FENCE = re.compile(r"^(\s*)```toml\s*$")
BASE: dict[str, Any] = {
    "issuer": "https://node.test",
    "data_dir": ".",
    "min_free_bytes": 1,
    "projects": {"base": {}},
}


def _markdown_files() -> list[Path]:
    return sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("conf/**/*.md"), ROOT / "README.md"])


def toml_blocks(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line number, marker or "", text) of every ```toml block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if start is None:
            i += 1
            continue
        indent = len(start.group(1))
        previous = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        marker = previous if previous in (COUNTER, FOREIGN) else ""
        body = []
        j = i + 1
        while lines[j].strip() != "```":
            body.append(lines[j][indent:])
            j += 1
        yield i + 1, marker, "\n".join(body) + "\n"
        i = j + 1


def _examples() -> list[Any]:
    cases = []
    for path in _markdown_files():
        for line, marker, text in toml_blocks(path):
            name = f"{path.relative_to(ROOT)}:{line}"
            cases.append(pytest.param(text, marker, id=name))
    for path in sorted(ROOT.glob("conf/*.toml")):
        text = path.read_text(encoding="utf-8")
        cases.append(pytest.param(text, "", id=str(path.relative_to(ROOT))))
        for line, table in commented_tables(text):
            cases.append(pytest.param(table, "", id=f"{path.relative_to(ROOT)}:{line}"))
    return cases


COMMENTED = re.compile(r"^# (\[[^\]]+\]|[A-Za-z_][A-Za-z0-9_]* = )")


def commented_tables(text: str) -> Iterator[tuple[int, str]]:
    """(line number, uncommented text) of every commented-out table of a TOML file."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("# ["):
            i += 1
            continue
        j = i
        while j < len(lines) and COMMENTED.match(lines[j]):
            j += 1
        yield i + 1, "\n".join(line[2:] for line in lines[i:j]) + "\n"
        i = j + 1


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def load_example(text: str, base_dir: Path) -> None:
    """Load one example as the daemons would; raises ConfigError (or TOMLDecodeError)."""
    raw = _merged(BASE, tomllib.loads(text))
    if raw["issuer"] == PLACEHOLDER_ISSUER:
        # The shipped example's issuer is refused on purpose (test_shipped_example_needs_an_issuer).
        raw["issuer"] = BASE["issuer"]
    parse_config(raw, base_dir)


@pytest.mark.parametrize(("text", "marker"), _examples())
def test_toml_example_loads(text: str, marker: str, tmp_path: Path) -> None:
    if marker == FOREIGN:
        tomllib.loads(text)
        return
    if marker == COUNTER:
        with pytest.raises((ConfigError, tomllib.TOMLDecodeError)):
            load_example(text, tmp_path)
        return
    load_example(text, tmp_path)


def test_the_test_sees_a_bad_example(tmp_path: Path) -> None:
    """The check above can fail: an example with {filename} in the identifier is caught."""
    bad = '[projects.x.delivery]\nsink = "directory"\npath = "/srv"\nidentifier = "{filename}"\n'
    bad += 'local_artifact_retention = "1h"\n'
    with pytest.raises(ConfigError, match=r"must not use \{filename\}"):
        load_example(bad, tmp_path)


def test_every_markdown_file_has_toml_found() -> None:
    """The extractor sees the indented block of docs/rsync.md and the marked pyproject blocks."""
    blocks = {p.name: list(toml_blocks(p)) for p in _markdown_files()}
    assert any("[rsync]" in text for _, _, text in blocks["rsync.md"])
    assert {m for _, m, _ in blocks["packaging.md"]} == {FOREIGN}


def test_commented_tables_are_found() -> None:
    text = (ROOT / "conf/canner.example.toml").read_text(encoding="utf-8")
    tables = [t.split("]")[0] for _, t in commented_tables(text)]
    assert tables.count("[projects.example.delivery") == 2
    assert "[ledger" in tables


def test_shipped_example_needs_an_issuer(tmp_path: Path) -> None:
    raw = tomllib.loads((ROOT / "conf/canner.example.toml").read_text(encoding="utf-8"))
    with pytest.raises(ConfigError, match="placeholder"):
        parse_config(raw, tmp_path)


HEADING = re.compile(r"^#+ .*`\[([^\]]+)\]`")


def key_tables() -> Iterator[Any]:
    """(table path, key) for every key listed in a key table under a heading naming a table."""
    for path in _markdown_files():
        section = None
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            heading = HEADING.match(line)
            if heading:
                section = heading.group(1)
            elif line.startswith("#"):
                section = None
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if section and line.startswith("|") and cells[0].startswith("`"):
                key = cells[0].strip("`")
                meaning = cells[-1]
                yield pytest.param(
                    section, key, meaning, id=f"{path.relative_to(ROOT)}:{number}:{key}"
                )


def test_key_tables_are_found() -> None:
    sections = {str(p.values[0]) for p in key_tables()}
    assert {"projects.<id>.delivery", "connections"} <= sections


PLACEHOLDER = re.compile(r"`(\{[a-z_]+\})`")


@pytest.mark.parametrize(("section", "key", "meaning"), list(key_tables()))
def test_key_table_names_a_known_key(section: str, key: str, meaning: str, tmp_path: Path) -> None:
    """Each key is known; each template placeholder a delivery row offers is accepted there
    (a "never `{x}`" in the row is not an offer)."""
    assert key in known_keys(section)
    if section != "projects.<id>.delivery" or key not in ("identifier", "remote_name"):
        return
    offered = {p for p in PLACEHOLDER.findall(meaning) if f"never `{p}`" not in meaning.lower()}
    assert offered
    for placeholder in offered:
        # {object_id} in the other template, so that any placeholder may stand alone here.
        table = {"identifier": "x-{object_id}", "remote_name": "{object_id}-{filename}"}
        table[key] = f"item-{placeholder}"
        lines = "".join(f'{k} = "{v}"\n' for k, v in table.items())
        load_example(
            '[projects.x.delivery]\nsink = "directory"\npath = "/srv"\n'
            f'local_artifact_retention = "1h"\n{lines}',
            tmp_path,
        )
