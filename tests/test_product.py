"""What ships reads as a product, not a lab notebook: nothing under gateway/ names a card or a date (measurements
live in docs/decisions/ and docs/benchmarks*.md), no module is over 600 lines without saying why, docs/benchmarks.md
is a short page whose command lines all parse, every relative link of the docs points to a file, and the README's
layout table matches the tree."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.benchmarks.settings import build_parser as bench_parser
from gateway.cli import build_parser as cli_parser
from gateway.devtools.devmodels import build_parser as model_maker_parser

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "gateway"
DOCS = ROOT / "docs"
BENCHMARKS_DOC = DOCS / "benchmarks.md"

# A card's name or a date: lab notes, which belong in docs/decisions/, not in the product's code or text.
LAB_NOTE = re.compile(r"H100|H200|A100|RTX ?\d{4}|20\d\d-[01]\d-[0-3]\d")
PRODUCT_SUFFIXES = (".py", ".js", ".html", ".css", ".md")
# The one card the product may name: the seed's, in the benchmarks' README, which reproduces the seed's tables.
SEED_QUOTE = (GATEWAY / "benchmarks" / "README.md", "RTX 4090")
MAX_MODULE_LINES = 600
OVERSIZE_REASON = "Over 600 lines because"  # the sentence a longer module's docstring must carry
MAX_BENCHMARKS_DOC_LINES = 400
CODE_BLOCK = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def product_files() -> Iterator[Path]:
    for path in sorted(GATEWAY.rglob("*")):
        if path.is_file() and path.suffix in PRODUCT_SUFFIXES and "__pycache__" not in path.parts:
            yield path


def lab_notes(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if path == SEED_QUOTE[0]:
            line = line.replace(SEED_QUOTE[1], "")
        found += [f"{path.relative_to(ROOT)}:{number}: {match}" for match in LAB_NOTE.findall(line)]
    return found


def test_nothing_under_gateway_names_a_card_or_a_date() -> None:
    found = [note for path in product_files() for note in lab_notes(path)]
    assert not found, "cards and dates go to docs/decisions/ (a comment keeps the rule and one line pointing " \
                      "there):\n" + "\n".join(found)


def test_the_lab_note_pattern_finds_cards_and_dates() -> None:
    for note in ("an H100 host", "on an H200", "A100", "RTX 4090", "RTX4090", "measured 2026-12-06"):
        assert LAB_NOTE.search(note), note
    for rule in ("20 ms frames", "HTTP 200", "max 4096 tokens", "H264", "RTX"):
        assert not LAB_NOTE.search(rule), rule


def test_no_module_is_over_600_lines_without_saying_why() -> None:
    oversized = []
    for path in sorted(GATEWAY.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES and OVERSIZE_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            oversized.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not oversized, f"split these, or say why in the module docstring ({OVERSIZE_REASON} ...):\n" + \
                          "\n".join(oversized)


def command_lines(markdown: str) -> list[str]:
    """Every `orpheus-gateway ...` and `python tools/...` command the page shows, in code blocks or inline."""
    commands = []
    for block in CODE_BLOCK.findall(markdown):
        commands += [line.strip() for line in block.splitlines()[1:-1]]
    commands += INLINE_CODE.findall(CODE_BLOCK.sub("", markdown))
    return [command for command in commands if command.startswith(("orpheus-gateway ", "python tools/"))]


def parser_of(subcommand: str) -> tuple[Callable[[], argparse.ArgumentParser], bool]:
    """The parser of `orpheus-gateway <subcommand>`, and whether it takes the arguments after the subcommand."""
    return {"bench": (bench_parser, True), "make-test-model": (model_maker_parser, True)}.get(subcommand,
                                                                                          (cli_parser, False))


def test_the_benchmarks_page_is_short_and_its_commands_parse() -> None:
    text = BENCHMARKS_DOC.read_text(encoding="utf-8")
    assert text.count("\n") < MAX_BENCHMARKS_DOC_LINES, "docs/benchmarks.md is the five-minute page: the dated " \
                                                         "record goes to docs/benchmarks-history.md"
    commands = command_lines(text)
    assert sum(command.startswith("orpheus-gateway bench ") for command in commands) >= 2, commands
    assert any(command.startswith("orpheus-gateway serve ") for command in commands), commands
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "python":
            assert (ROOT / argv[1]).is_file(), f"{command}: no {argv[1]}"
            continue
        make_parser, after_subcommand = parser_of(argv[1])
        try:
            make_parser().parse_args(argv[2:] if after_subcommand else argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"docs/benchmarks.md: `{command}` does not parse") from exc


def test_a_command_that_does_not_parse_is_caught() -> None:
    make_parser, after_subcommand = parser_of("bench")
    assert after_subcommand
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--no-such-flag"])


def relative_links(path: Path) -> list[str]:
    targets = (match.split("#", 1)[0] for match in LINK.findall(CODE_BLOCK.sub("", path.read_text(encoding="utf-8"))))
    return [target for target in targets if target and not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_of_the_docs_points_to_a_file(page: Path) -> None:
    missing = [target for target in relative_links(page) if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to what is not there: {missing}"


def readme_layout() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme[readme.index("## Layout"):readme.index("\n## ", readme.index("## Layout") + 1)]


def test_the_readme_layout_table_matches_the_tree() -> None:
    """Every package, top-level module and shipped folder of gateway/ has a row, every module a package's row names
    exists, and every path the table names exists."""
    table = readme_layout()
    rows = {match.group(1) for match in re.finditer(r"^\| `([^`]+)` \|", table, re.M)}
    expected = {f"gateway/{p.name}/" for p in GATEWAY.iterdir() if p.is_dir() and p.name != "__pycache__"}
    expected |= {f"gateway/{p.name}" for p in GATEWAY.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert expected <= rows, sorted(expected - rows)
    missing = [row for row in rows if not (ROOT / row).exists()]
    assert not missing, missing
    for line in table.splitlines():
        package = re.match(r"^\| `gateway/(\w+)/` \|", line)
        if package is None:
            continue
        folder = GATEWAY / package.group(1)
        cell = line.split("|")[2]
        named = {name.rstrip("/") for name in INLINE_CODE.findall(cell) if re.fullmatch(r"[a-z_]+/?", name)}
        modules = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
        assert named <= modules, (package.group(1), sorted(named - modules))
