"""Write servekit's configuration files into a folder, to edit and to use with the plain commands.

    servekit init                 # ./config (config.properties, metrics.yaml, models/) and ./k8s
    servekit init DIR --only config

servekit's commands read the packaged copies of these files when the current directory has none;
`torchserve --start --ts-config config/config.properties` and `kubectl apply -k k8s/overlays/gpu`
need them on disk. Existing files are never overwritten unless --force is given.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from servekit.resources import config_dir, k8s_dir

SKIP = ("__init__.py", "__pycache__")


def _files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and not any(s in p.parts or p.name == s for s in SKIP)
                  and p.suffix != ".pyc")


def write(out: Path, parts: tuple[str, ...] = ("config", "k8s"), force: bool = False) -> list[Path]:
    """Copy the packaged `config/` and/or `k8s/` folders under `out`; returns the files written.
    Raises FileExistsError, naming every clash, before writing anything unless `force`."""
    sources = {"config": config_dir(), "k8s": k8s_dir()}
    plan = [(f, out / part / f.relative_to(sources[part])) for part in parts for f in _files(sources[part])]
    clashes = [str(dst) for _, dst in plan if dst.exists()]
    if clashes and not force:
        raise FileExistsError(f"{len(clashes)} file(s) exist already (--force overwrites): "
                              + ", ".join(clashes[:5]) + (" ..." if len(clashes) > 5 else ""))
    for src, dst in plan:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return [dst for _, dst in plan]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit init", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, nargs="?", default=Path("."), help="folder to write into (default: .)")
    p.add_argument("--only", choices=("config", "k8s"), help="write only this folder")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")
    args = p.parse_args(argv)
    try:
        written = write(args.dir, (args.only,) if args.only else ("config", "k8s"), args.force)
    except OSError as e:
        print(f"servekit init: error: {e}", file=sys.stderr)
        return 2
    for part in sorted({w.relative_to(args.dir).parts[0] for w in written}):
        n = sum(w.relative_to(args.dir).parts[0] == part for w in written)
        print(f"wrote {args.dir / part}/ ({n} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
