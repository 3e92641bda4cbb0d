"""benchmarks/results/ holds only runs that back a figure README.md or a docs/ page cites, and every
results path those pages cite exists; each results folder says the command that made it.

Everything is derived from the files themselves: a page or a results folder added later is
checked the same way, with no list to keep up to date."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREFIX = "benchmarks/results/"
# A cited path runs until a character that cannot be part of it (backtick, space, bracket, quote).
CITED = re.compile(re.escape(PREFIX) + r"([^\s`'\")\]]*)")
BACKTICKED = re.compile(r"`([^`\s]+)`")
# Where a command writes a run (`--out benchmarks/results/x-h100`) is a destination, not a citation.
OUTPUT = re.compile(r"--out[=\s]+" + re.escape(PREFIX) + r"\S*")
# A command that reproduces a run: the servekit CLI, a servekit module, or a script of benchmarks/.
COMMAND = re.compile(r"(python3? -m servekit|servekit (bench|archive|train-speculator)\b|bash benchmarks/)")


def citing_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def expand_braces(token: str) -> list[str]:
    """`reliability-soak.{json,md}` -> reliability-soak.json, reliability-soak.md."""
    parts = re.split(r"\{([^{}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_paths(text: str) -> set[str]:
    """Paths under benchmarks/results/ a page names, without a trailing slash or full stop.
    Templates (`minilm-gpu-<gpu>`), the bare folder and commands' output folders are not citations."""
    paths = set()
    for match in CITED.finditer(OUTPUT.sub("", text)):
        path = match.group(1).rstrip(".,:;").rstrip("/")
        if path and "<" not in path and "*" not in path:
            paths.update(expand_braces(path))
    return paths


def citations() -> dict[str, set[str]]:
    """Each cited path -> the pages citing it. A page that names the folder `benchmarks/results/`
    itself and then a top-level file of it in backticks (`reliability-soak.{json,md}`) cites that
    file too."""
    top_files = {p.name for p in RESULTS.iterdir() if p.is_file()}
    cited: dict[str, set[str]] = {}
    for page in citing_pages():
        text = page.read_text(encoding="utf-8")
        names = cited_paths(text)
        if PREFIX in text:
            for token in BACKTICKED.findall(text):
                names.update(n for n in expand_braces(token) if n in top_files)
        for name in names:
            cited.setdefault(name, set()).add(str(page.relative_to(ROOT)))
    return cited


def results_entries() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if not p.name.startswith("."))


def test_expand_braces_and_cited_paths() -> None:
    assert expand_braces("a.{json,md}") == ["a.json", "a.md"]
    text = ("see `benchmarks/results/x-h100/`, benchmarks/results/y/sub. and "
            "`--out benchmarks/results/minilm-gpu-<gpu>`, `--out benchmarks/results/new-h100` or "
            "`--out benchmarks/results`")
    assert cited_paths(text) == {"x-h100", "y/sub"}


def test_every_cited_results_path_exists() -> None:
    missing = {path: sorted(pages) for path, pages in citations().items() if not (RESULTS / path).exists()}
    assert not missing, f"cited results that do not exist (path: citing pages): {missing}"


def test_every_results_entry_is_cited() -> None:
    cited_tops = {path.split("/")[0] for path in citations()}
    uncited = [p.name for p in results_entries() if p.name not in cited_tops]
    assert not uncited, (f"benchmarks/results/ entries that README.md and docs/ never cite: {uncited}; "
                         "cite the figure they back, or delete them (git history keeps them)")


@pytest.mark.parametrize("folder", [p for p in results_entries() if p.is_dir()], ids=lambda p: p.name)
def test_results_folder_says_its_command(folder: Path) -> None:
    """A README.md, or a file named command*, says the command that made the run."""
    notes = [p for p in (folder / "README.md", *sorted(folder.glob("command*"))) if p.is_file()]
    assert notes, f"{folder.relative_to(ROOT)} has no README.md or command file saying how it was made"
    assert any(COMMAND.search(n.read_text(encoding="utf-8")) for n in notes), \
        f"{folder.relative_to(ROOT)}: {[n.name for n in notes]} name no command (python -m servekit..., servekit bench ...)"
