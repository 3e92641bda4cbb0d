"""Start TorchServe with config/ and the archives in model_store/, in the foreground (Ctrl-C stops)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from servekit.resources import resolve
from servekit.torchserve import Ports, PortTaken, ServerError, TorchServe, read_properties


def model_names(models: str) -> list[str]:
    """The names of TorchServe's ``--models`` value (``name=archive.mar`` or ``archive.mar`` entries,
    separated by spaces or commas); ``all`` names none (the store's archives, unknown here)."""
    names = []
    for entry in models.replace(",", " ").split():
        if entry != "all":
            names.append(entry.split("=", 1)[0] if "=" in entry else Path(entry).name.removesuffix(".mar"))
    return names


def announce_ready(ts: TorchServe, models: list[str], timeout: float = 3600.0) -> None:
    """For each model loaded at start: wait for a READY worker, send the frontend its warm-up
    requests (``TorchServe.warm_up``: a fresh frontend's first requests otherwise pay for its
    prediction path's first run and for the JVM interpreting it) and say the model is ready."""
    for model in models:
        try:
            seconds = ts.api.wait_ready(model, 1, timeout)
            statuses = ts.warm_up(model)
        except (ServerError, OSError) as e:
            print(f"{model}: not ready: {str(e).splitlines()[0]}", flush=True)
            continue
        warmed = ", ".join(f"{v} {status or 'no answer'}" for v, status in statuses.items())
        print(f"{model}: ready after {seconds:.0f} s (inference path warmed: {warmed})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit serve", description=__doc__)
    p.add_argument("--models", default="minilm=minilm.mar", help="models to load at start (TorchServe --models syntax)")
    p.add_argument("--model-store", type=Path, default=Path("model_store"),
                   help="folder with the archives (default: model_store/)")
    p.add_argument("--config", type=Path, default=Path("config/config.properties"),
                   help="config.properties, ports taken from it (default: ./config/config.properties, else "
                        "servekit's packaged one)")
    p.add_argument("--log-config", type=Path, default=Path("config/log4j2.xml"),
                   help="the frontend's log4j2 configuration (default: ./config/log4j2.xml, else servekit's "
                        "packaged one: an access log line per request, no lines per batch)")
    p.add_argument("--run-dir", type=Path, default=Path(".run/serve"),
                   help="logs, pid file, resolved config (default: .run/serve)")
    args = p.parse_args(argv)
    args.config = resolve(args.config)
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    args.log_config = resolve(args.log_config)
    if not args.log_config.is_file():
        p.error(f"--log-config {args.log_config}: no such file")
    props = read_properties(args.config)
    port = lambda key: int(props[key].rsplit(":", 1)[1])  # noqa: E731
    ports = Ports(port("inference_address"), port("management_address"), port("metrics_address"),
                  int(props.get("grpc_inference_port", 7070)), int(props.get("grpc_management_port", 7071)))
    # Ctrl-C and SIGTERM (a service manager, `kill`) both stop TorchServe and its workers, which run
    # in a session of their own and would outlive this process. Handlers set here, not inherited:
    # a parent that ignores SIGINT (a script's background job) would otherwise leave no way but kill -9.
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    # The models load at start (--models); the config decides the model API (shipped: off).
    ts = TorchServe(args.run_dir, args.model_store, ports, args.config, models=args.models, model_api=False,
                    log_config=args.log_config)
    try:
        ts.start()  # a start that fails leaves nothing running
    except PortTaken:
        print(f"servekit serve: error: a port of {args.config} is in use (inference {ports.inference}, management "
              f"{ports.management}, metrics {ports.metrics}, gRPC {ports.grpc_inference}/{ports.grpc_management}): "
              f"another server is running; stop it or give --config with other ports (log: {ts.log_dir}/server.out)",
              file=sys.stderr)
        return 1
    except (ServerError, OSError) as e:  # no model store, no Java, a frontend that exited
        print(f"servekit serve: error: {e}", file=sys.stderr)
        return 1
    try:
        print(f"TorchServe: inference {ts.inference_url}, management {ts.management_url}, metrics {ts.metrics_url}",
              flush=True)
        print(f"logs in {ts.log_dir}, worker sockets and pid file in {ts.temp_dir}; Ctrl-C to stop", flush=True)
        threading.Thread(target=announce_ready, args=(ts, model_names(args.models)), daemon=True).start()
        while not stopping:
            signal.pause()
    finally:
        ts.stop()
    return 0
