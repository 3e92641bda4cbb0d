"""servekit: from PyTorch weights to a tuned, monitored TorchServe deployment.

One import namespace, several source folders (mapped in pyproject.toml):

    servekit                 this folder: CLI, the TorchServe client, pod probe, archive builder,
                             demo, deploy tools (Kubernetes overlay, Grafana dashboards)
    servekit.handlers        handlers/       TorchServe handlers (the only code importing `ts`)
    servekit.optimizations   optimizations/  the runtime: models, plans, CUDA graphs, the LLM runner
    servekit.benchmarks      benchmarks/     the auto-benchmark and benchmark scripts
    servekit.config          config/         config.properties, metrics.yaml, model-configs (data)
    servekit.k8s             k8s/            Kustomize manifests and dashboards (data)
"""
__version__ = "0.1.0"
