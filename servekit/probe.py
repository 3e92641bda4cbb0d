"""Pod lifecycle commands for servekit's Kubernetes Deployment, talking to TorchServe's management API.

    python -m servekit.probe ready --model minilm --config /etc/servekit/config.properties
    python -m servekit.probe register --config /etc/servekit/config.properties

Both find the management API at the config's `management_address` (--management overrides it).

`ready` is the startup and readiness probe: TorchServe's /ping answers Healthy before any worker
has loaded (and while every worker restarts), so readiness asks `GET /models/<name>` instead.
`register` is the postStart hook: it registers every model of the config's `models` line with the
workers and batching written there (TorchServe itself would let the archive's model-config win).

Kubelet runs the probe every few seconds: this module imports nothing beyond the standard library
(no torch; only servekit.torchserve's stdlib HTTP helpers) and starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse

# Standard library only (servekit.torchserve imports nothing else at module level).
from servekit.torchserve import http_json, read_properties

DEFAULT_MANAGEMENT = "http://127.0.0.1:8081"


def _text(body: object) -> str:
    return body if isinstance(body, str) else json.dumps(body)


def worker_states(management: str, model: str, timeout: float = 3.0) -> list[str]:
    """Status of every worker of every version of `model`. Raises OSError / ValueError on failure."""
    status, body = http_json("GET", f"{management}/models/{urllib.parse.quote(model, safe='')}", timeout)
    if status == 404:
        raise ValueError(f"model {model!r} is not registered")
    if status != 200 or not isinstance(body, list):
        raise ValueError(f"GET /models/{model} answered {status}: {str(body)[:200]}")
    return [w.get("status", "?") for version in body for w in version.get("workers", [])]


def ready(management: str, model: str, timeout: float = 3.0) -> tuple[bool, str]:
    try:
        states = worker_states(management, model, timeout)
    except OSError as e:
        return False, f"management API at {management} not answering: {e}"
    except ValueError as e:
        return False, str(e)
    if "READY" in states:
        return True, f"{model}: {states.count('READY')}/{len(states)} workers READY"
    return False, f"{model}: no READY worker (workers: {', '.join(states) or 'none'})"


def management_url(explicit: str | None, config: str | None) -> str:
    if explicit:
        return explicit.rstrip("/")
    if config:
        address = read_properties(config).get("management_address")
        if address:
            return address.rstrip("/")
    return DEFAULT_MANAGEMENT


def registrations(props: dict[str, str]) -> list[dict[str, str]]:
    """Management API parameters for each model of the `models` property (TorchServe's format:
    {"name": {"version": {"marName", "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
    "responseTimeout"}}})."""
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
            params = {"url": spec["marName"], "model_name": name, "synchronous": "false",
                      "initial_workers": str(spec.get("minWorkers", 1))}
            for key, api_key in (("batchSize", "batch_size"), ("maxBatchDelay", "max_batch_delay"),
                                 ("responseTimeout", "response_timeout"), ("startupTimeout", "startup_timeout")):
                if key in spec:
                    params[api_key] = str(spec[key])
            params["min_worker"] = str(spec.get("minWorkers", 1))
            params["max_worker"] = str(spec.get("maxWorkers", spec.get("minWorkers", 1)))
            out.append(params)
    return out


def register(management: str, config: str, deadline_s: float = 120.0) -> str:
    """Register every model of `config` (waiting for the management API to come up), then set its
    worker count. Models already registered (a container restart keeps nothing, but a second run
    of the hook would) are only scaled. Returns a summary; raises RuntimeError on failure."""
    regs = registrations(read_properties(config))
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            http_json("GET", f"{management}/models", 3)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"management API at {management} did not answer within {deadline_s:.0f}s: {e}")
            time.sleep(0.5)
    done = []
    for params in regs:
        workers = {"min_worker": params.pop("min_worker"), "max_worker": params.pop("max_worker"),
                   "synchronous": "false"}
        name = params["model_name"]
        status, body = http_json("POST", f"{management}/models?{urllib.parse.urlencode(params)}", 30)
        body = _text(body)
        if status >= 300 and not (status == 409 or "already registered" in body):
            raise RuntimeError(f"registering {name} ({params['url']}) failed with {status}: {body.strip()[:300]}")
        # The archive's model-config may set minWorkers/maxWorkers, which win over initial_workers:
        # set the count explicitly.
        status, body = http_json("PUT", f"{management}/models/{urllib.parse.quote(name, safe='')}?"
                                 f"{urllib.parse.urlencode(workers)}", 30)
        body = _text(body)
        if status >= 300:
            raise RuntimeError(f"setting {name}'s workers to {workers['min_worker']} failed with {status}: "
                               f"{body.strip()[:300]}")
        done.append(f"{name}: batch_size={params.get('batch_size', '-')} max_batch_delay="
                    f"{params.get('max_batch_delay', '-')} workers={workers['min_worker']}")
    return "registered " + "; ".join(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servekit.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("ready", help="exit 0 iff some worker of the model is READY")
    r.add_argument("--model", required=True)
    r.add_argument("--config", help="TorchServe config.properties to read management_address from")
    r.add_argument("--timeout", type=float, default=3.0, help="seconds for the HTTP call")
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
        ok, message = ready(management, args.model, args.timeout)
        print(message, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    try:
        print(register(management, args.config, args.deadline))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
