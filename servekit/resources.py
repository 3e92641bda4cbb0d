"""Where servekit's own files are, in a checkout and in an installed wheel alike.

Everything a command reads by default (config.properties, metrics.yaml, model-configs, sweep
files, payloads, Kubernetes manifests, dashboards) is package data, found through
`importlib.resources`; nothing is located relative to the source tree. What a command writes
(archives, run folders, results) goes under the current directory.

Paths the user writes (on the command line or in a sweep file) keep their project-relative form:
`config/models/minilm.yaml` is that file in the current directory when it exists there, and
otherwise the packaged file of that name, so the README's commands work from a checkout and from
anywhere else once the wheel is installed.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# Project-relative folder -> (the package holding its files once installed, folder inside it).
_DATA_FOLDERS: tuple[tuple[str, str, str], ...] = (
    ("benchmarks/test_handlers", "servekit.benchmarks.test_handlers", ""),
    ("benchmarks/sweeps", "servekit.benchmarks", "sweeps"),
    ("benchmarks/payloads", "servekit.benchmarks", "payloads"),
    ("optimizations/data", "servekit.optimizations", "data"),
    ("config", "servekit.config", ""),
    ("k8s", "servekit.k8s", ""),
)


def package_dir(package: str) -> Path:
    """The folder of an installed (or editable) servekit package, e.g. `servekit.handlers`."""
    return Path(str(files(package)))


def config_dir() -> Path:
    """The packaged `config/` folder: config.properties, metrics.yaml, models/*.yaml."""
    return package_dir("servekit.config")


def model_config(name: str) -> Path:
    """The packaged model-config `config/models/<name>.yaml`."""
    return config_dir() / "models" / f"{name}.yaml"


def k8s_dir() -> Path:
    """The packaged `k8s/` folder: base, overlays, monitoring, components."""
    return package_dir("servekit.k8s")


def packaged(relative: str | Path) -> Path | None:
    """The packaged file for a project-relative path (`config/config.properties`), or None when
    the path names no packaged folder."""
    rel = Path(relative)
    if rel.is_absolute():
        return None
    parts = rel.parts
    for prefix, package, inner in _DATA_FOLDERS:
        n = len(Path(prefix).parts)
        if parts[:n] == Path(prefix).parts:
            return package_dir(package).joinpath(inner, *parts[n:])
    return None


def resolve(path: str | Path, base: Path | None = None) -> Path:
    """A user-given path: absolute as given; relative to `base` (default: the current directory)
    when it exists there; else the packaged file of that project-relative name when there is one;
    else relative to `base` (so that an error names the path the user wrote)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    local = p if base is None else base / p  # as written, so that messages name the user's path
    if local.exists():
        return local
    data = packaged(p)
    if data is not None and data.exists():
        return data
    return local
