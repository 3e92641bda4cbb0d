"""`servekit` command line: thin wrappers over the plain commands (each also runs on its own)."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("servekit.init", "write config/ and k8s/ into a folder, to edit and use with the plain commands"),
    "archive": ("servekit.archive", "build a self-contained .mar into model_store/ (minilm, smollm2, or a model folder / .gguf)"),
    "serve": ("servekit.serve", "start TorchServe with config/ and the archives, in the foreground"),
    "gateway": ("servekit.gateway", "streaming proxy before TorchServe: a worker dying mid-stream ends the stream with an error event"),
    "demo": ("servekit.demo", "archive, serve, send real requests, print results, stop"),
    "bench": ("servekit.benchmarks.bench.runner", "SLA-driven auto-benchmark from a YAML sweep: report + recommendation"),
    "train-speculator": ("servekit.optimizations.training.train_speculator", "train speculative-decoding heads for a Llama model"),
    "dashboards": ("servekit.deploy.dashboards", "build the Grafana dashboards, or push them to a Grafana URL"),
    "overlay": ("servekit.deploy.overlay", "write a Kubernetes overlay from a benchmark's recommendation.json"),
}


def usage() -> str:
    lines = ["usage: servekit <command> [args]   (servekit <command> --help for details)", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"servekit: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
