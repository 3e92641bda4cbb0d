"""Pod lifecycle commands for servekit's Kubernetes Deployment, talking to TorchServe's management API.

    python -m servekit.probe ready --model minilm --config /etc/servekit/config.properties
    python -m servekit.probe register --config /etc/servekit/config.properties

Both find the management API at the config's `management_address` (--management overrides it).

`ready` is the startup and readiness probe: TorchServe's /ping answers Healthy before any worker
has loaded (and while every worker restarts), so readiness asks `GET /models/<name>` instead.
With `--warm-up` (the startup probe) it then sends requests through the inference API (500 on the
models route within 2 s; for an LLM, that within 1 s, then streamed two-token chats until 1.5 s,
then two bursts of as many concurrent chats as it runs at once), so that users' requests do not
pay for the frontend's first use of its prediction path, for the JVM interpreting it, nor, on an
LLM, for the paths a burst of users first runs (servekit.torchserve.warm_up_inference); the pod
turns ready only after that.
`register` registers every model of a config's `models` line with the workers and batching written
there, on a server whose model API is on. servekit's pods do not use it: their model API is off and
TorchServe registers their `model_snapshot` models at start (docs/security.md).

Kubelet runs the probe every few seconds: this module imports nothing beyond the standard library
(no torch; servekit.torchserve's management client is standard library only at import) and starts
in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys

# Standard library only (servekit.torchserve imports nothing else at module level).
from servekit.torchserve import ManagementClient, Registration, ServerError, read_properties, warm_up_inference

DEFAULT_MANAGEMENT = "http://127.0.0.1:8081"
DEFAULT_INFERENCE = "http://127.0.0.1:8080"


def worker_states(management: str, model: str, timeout: float = 3.0) -> dict[str, list[str]]:
    """Status of every worker of each version of `model`. Raises ServerError on failure."""
    described = ManagementClient(management).describe(model, timeout)
    if described is None:
        raise ServerError(f"model {model!r} is not registered")
    return {v.get("modelVersion", "1.0"): [w.get("status", "?") for w in v.get("workers", [])] for v in described}


def ready(management: str, model: str, timeout: float = 3.0, warm_up: str | None = None) -> tuple[bool, str]:
    """Whether a worker of `model` is READY, and a line saying so. `warm_up`: the inference API to
    send, once ready, the warm-up requests of each READY version through (``warm_up_inference``)."""
    try:
        versions = worker_states(management, model, timeout)
    except ServerError as e:
        return False, str(e)
    states = [s for v in versions.values() for s in v]
    if "READY" not in states:
        return False, f"{model}: no READY worker (workers: {', '.join(states) or 'none'})"
    message = f"{model}: {states.count('READY')}/{len(states)} workers READY"
    for version, v in versions.items():
        if warm_up is not None and "READY" in v:
            status = warm_up_inference(warm_up, model, version, timeout)
            message += f"; inference warm-up of {version}: {status or 'no answer'}"
    return True, message


def management_url(explicit: str | None, config: str | None) -> str:
    return _address(explicit, config, "management_address", DEFAULT_MANAGEMENT)


def inference_url(explicit: str | None, config: str | None) -> str:
    """The inference API to call from inside the pod: the config's ``inference_address`` with a
    wildcard host (0.0.0.0, the pod's listening address) read as 127.0.0.1."""
    return _address(explicit, config, "inference_address", DEFAULT_INFERENCE).replace("//0.0.0.0:", "//127.0.0.1:")


def _address(explicit: str | None, config: str | None, key: str, default: str) -> str:
    if explicit:
        return explicit.rstrip("/")
    if config:
        address = read_properties(config).get(key)
        if address:
            return address.rstrip("/")
    return default


def registrations(props: dict[str, str]) -> list[Registration]:
    """The models of the `models` property (TorchServe's format: {"name": {"version": {"marName",
    "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout"}}})."""
    if "models" not in props:
        raise ValueError("the config has no `models` line: nothing to register")
    try:
        models = json.loads(props["models"])
    except ValueError as e:
        raise ValueError(f"the `models` line is not JSON: {e}") from None
    out = []
    for name, versions in models.items():
        for version, spec in versions.items():
            unknown = set(spec) - {"marName", "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
                                   "responseTimeout", "startupTimeout"}
            if unknown or "marName" not in spec:
                raise ValueError(f"models[{name!r}][{version!r}]: needs marName; unknown keys {sorted(unknown)}")
            out.append(Registration(spec["marName"], name, int(spec.get("minWorkers", 1)), spec.get("batchSize"),
                                    spec.get("maxBatchDelay"), spec.get("responseTimeout"),
                                    spec.get("startupTimeout")))
    return out


def register(management: str, config: str, deadline_s: float = 120.0) -> str:
    """Register every model of `config` (waiting for the management API to come up) with the
    workers and batching written there; a model registered already (a second run of the hook) is
    only scaled. Does not wait for the workers: the readiness probe does. Returns a summary;
    raises ServerError on failure."""
    regs = registrations(read_properties(config))
    client = ManagementClient(management)
    client.wait_reachable(deadline_s)
    done = []
    for reg in regs:
        client.register(reg, if_exists="keep", wait=False)
        done.append(f"{reg.model}: batch_size={reg.batch_size if reg.batch_size is not None else '-'} "
                    f"max_batch_delay={reg.max_batch_delay_ms if reg.max_batch_delay_ms is not None else '-'} "
                    f"workers={reg.workers}")
    return "registered " + "; ".join(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servekit.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("ready", help="exit 0 iff some worker of the model is READY")
    r.add_argument("--model", required=True)
    r.add_argument("--config", help="TorchServe config.properties to read management_address from")
    r.add_argument("--timeout", type=float, default=3.0, help="seconds for the HTTP call")
    r.add_argument("--warm-up", action="store_true",
                   help="once ready, send requests through the inference API (the models route, which "
                        "servekit's handlers answer without the model, 500; for an LLM half the time, then "
                        "streamed two-token chats, not counted in servekit's metrics; at most 2 s in all) so that "
                        "real requests do not pay for loading and compiling its prediction path: for the "
                        "startup probe")
    r.add_argument("--inference", help=f"TorchServe inference API URL for --warm-up (default: the config's "
                                       f"inference_address, else {DEFAULT_INFERENCE})")
    g = sub.add_parser("register", help="register the models of a config.properties `models` line")
    g.add_argument("--config", required=True)
    g.add_argument("--deadline", type=float, default=120.0,
                   help="seconds to wait for the management API to answer")
    for p in (r, g):
        p.add_argument("--management", help=f"TorchServe management API URL (default: the config's "
                                            f"management_address, else {DEFAULT_MANAGEMENT})")
    args = parser.parse_args(argv)
    try:
        management = management_url(args.management, args.config)
    except OSError as e:
        print(f"error: cannot read {args.config}: {e}", file=sys.stderr)
        return 1
    if args.command == "ready":
        ok, message = ready(management, args.model, args.timeout,
                            inference_url(args.inference, args.config) if args.warm_up else None)
        print(message, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    try:
        print(register(management, args.config, args.deadline))
    except (OSError, ValueError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
