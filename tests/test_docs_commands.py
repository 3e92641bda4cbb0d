"""Every shell command in README.md and docs/*.md is checked without running the slow part: the
arguments of `servekit ...` and `python -m servekit....` parse with that command's own argparse
parser, `torchserve` and `torch-model-archiver` arguments with TorchServe's parsers, every
`kubectl apply -k` path builds with `kubectl kustomize`, `make` targets exist, and every repository
path a page names (in a command or in backticks) and every relative link exists.

Pages are found by globbing docs/, so a page added later is checked the same way."""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib
import inspect
import io
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from servekit.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
# Folders of this repository whose paths a page may name; other paths (build/, model_store/, ~/...)
# are written by the commands themselves.
REPO_DIRS = ("benchmarks", "config", "docs", "handlers", "k8s", "optimizations", "servekit", "tests")
REPO_PATH = re.compile(rf"^(?:{'|'.join(REPO_DIRS)})/[\w./*-]*$")
PLACEHOLDER = re.compile(r"<|>|\bDIR\b|\bNAME\b|\bFILE\b|\.\.\.|\$")
OUTPUT_FLAGS = {"--out", "--export-path", "-o"}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each shell block: fenced as bash/sh/none, or indented 4 spaces."""
    blocks: list[tuple[int, list[str]]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            if fence.group(1) in SHELL_FENCES:
                blocks.append((i + 2, lines[i + 1:end]))
            i = end + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append((i + 1, [ln[4:] for ln in lines[i:end]]))
            i = end
            continue
        i += 1
    return blocks


def without_redirections(tokens: list[str]) -> list[str]:
    """Drop `> file`, `2>&1`, `>>file` and the like: the shell's business, not the command's."""
    kept: list[str] = []
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif re.fullmatch(r"\d*(>>?|<|&>)", token):
            skip_next = True
        elif not re.fullmatch(r"\d*(>>?|<|&>)\S+|\d*>&\d+", token):
            kept.append(token)
    return kept


def commands_of(page: Path) -> list[Command]:
    """Each simple command of each shell block, continuation lines joined, comments dropped, split
    at `&&`, `;` and `|`, leading VAR=value assignments removed."""
    rel = str(page.relative_to(ROOT))
    found: list[Command] = []
    for start, lines in code_blocks(page.read_text(encoding="utf-8")):
        if any(line.startswith("$ ") for line in lines):  # a transcript: commands after "$ ", output between
            lines = [line[2:] if line.startswith("$ ") else "" for line in lines]
        joined: list[tuple[int, str]] = []
        pending, first = "", 0
        for offset, line in enumerate(lines):
            if not pending:
                first = start + offset
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            joined.append((first, pending))
            pending = ""
        for number, line in joined:
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # not shell (a diagram, Python): nothing to check
                continue
            part: list[str] = []
            tokens = without_redirections(tokens)
            for token in [*tokens, "&&"]:
                if token in ("&&", ";", "|", "||", "&"):
                    while part and re.match(r"^\w+=", part[0]):
                        part.pop(0)
                    if part and "..." not in part:  # an elided command, e.g. a diagram of the path
                        found.append(Command(rel, number, tuple(part)))
                    part = []
                else:
                    part.append(token)
    return found


ALL_COMMANDS = [c for page in PAGES for c in commands_of(page)]


def servekit_target(argv: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(module, its arguments) for `servekit X ...`, `python -m servekit X ...` and
    `python -m servekit.module ...`; None for any other command; ValueError for an unknown X."""
    prog = Path(argv[0]).name
    if prog == "servekit":
        sub, args = argv[1], list(argv[2:])
    elif re.fullmatch(r"python3?", prog) and len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("servekit"):
        if argv[2] != "servekit":
            return argv[2], list(argv[3:])
        sub, args = argv[3], list(argv[4:])
    else:
        return None
    if sub not in COMMANDS:
        raise ValueError(f"unknown servekit command {sub!r}")
    return COMMANDS[sub][0], args


class _Parsed(Exception):
    pass


def dry_parse(run: Callable[[], object], args: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Call `run` until the first argparse parser it builds has parsed `args` (in place of the
    command line); '' when they parse, else the parser's error message. Nothing after the parse runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, _args: object = None, namespace: object = None) -> None:
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed:
        return ""
    except SystemExit as exc:
        return err.getvalue().strip() or f"exit {exc.code}"
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    return "returned without parsing its arguments"


def module_main(module_name: str, args: list[str]) -> Callable[[], object]:
    module = importlib.import_module(module_name)
    assert hasattr(module, "main"), f"{module_name} has no main()"
    if not inspect.signature(module.main).parameters:  # main() reads sys.argv: dry_parse hands its parser `args`
        return module.main
    return lambda: module.main(args)


def outputs_of(block_commands: list[Command]) -> set[str]:
    return {c.argv[i + 1].rstrip("/") for c in block_commands for i, a in enumerate(c.argv[:-1]) if a in OUTPUT_FLAGS}


@functools.cache
def kustomize(path: str) -> str:
    proc = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60)
    return "" if proc.returncode == 0 else proc.stderr.strip()


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def repo_path_exists(path: str) -> bool:
    return bool(glob.glob(str(ROOT / path))) if "*" in path else (ROOT / path).exists()


def check(command: Command, monkeypatch: pytest.MonkeyPatch, produced: set[str]) -> str:
    """'' when the command checks out, else what is wrong."""
    argv = command.argv
    prog = Path(argv[0]).name
    try:
        target = servekit_target(argv)
    except ValueError as exc:
        return str(exc)
    if target:
        return dry_parse(module_main(*target), target[1], monkeypatch)
    if prog == "torchserve":
        from ts.arg_parser import ArgParser
        return dry_parse(lambda: ArgParser.ts_parser().parse_args(), list(argv[1:]), monkeypatch)
    if prog == "torch-model-archiver":
        from model_archiver.arg_parser import ArgParser
        return dry_parse(ArgParser.export_model_args_parser, list(argv[1:]), monkeypatch)
    if prog == "kubectl" and argv[1:3] == ("apply", "-k"):
        path = argv[3].rstrip("/")
        if path in produced:  # written by a command just above (servekit.deploy.overlay --out)
            return ""
        if shutil.which("kubectl") is None:
            pytest.skip("kubectl not installed")
        return kustomize(path)
    if prog == "make":
        # make's own arguments: options (-j2) and variables (TEST_WORKERS=4) besides the targets
        missing = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in make_targets()]
        return f"no make target {missing}" if missing else ""
    return ""


def paths_named(command: Command) -> list[str]:
    """Repository paths among a command's arguments, outputs (after --out) excluded."""
    names = []
    for i, token in enumerate(command.argv):
        if i and command.argv[i - 1] in OUTPUT_FLAGS:
            continue
        for piece in re.split(r"[=:,]", token):
            if REPO_PATH.match(piece) and not PLACEHOLDER.search(piece):
                names.append(piece)
    return names


def test_commands_found() -> None:
    """The extraction sees the commands a reader runs (the README's four steps among them)."""
    readme = [c.argv for c in ALL_COMMANDS if c.page == "README.md"]
    assert (".venv/bin/servekit", "archive", "minilm") in readme
    assert any(argv[:3] == ("kubectl", "apply", "-k") for argv in readme)
    assert len(ALL_COMMANDS) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_commands_parse(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = str(page.relative_to(ROOT))
    page_commands = [c for c in ALL_COMMANDS if c.page == rel]
    produced = outputs_of(page_commands)
    problems = []
    for command in page_commands:
        problem = check(command, monkeypatch, produced)
        if problem:
            problems.append(f"{command}\n    {problem.splitlines()[-1]}")
        problems += [f"{command}\n    no such path: {p}" for p in paths_named(command)
                     if p.rstrip("/") not in produced and not repo_path_exists(p)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_paths_and_links_exist(page: Path) -> None:
    """Repository paths in backticks and relative links ([text](target)) point at something."""
    text = page.read_text(encoding="utf-8")
    missing = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(".,:;")
        if REPO_PATH.match(token) and not PLACEHOLDER.search(token) and not repo_path_exists(token):
            missing.append(token)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"
