"""The SLA-driven auto-benchmark (`servekit bench <yaml>`): schema, load generation, statistics,
SLA search, server-side metrics, report. Entry point: servekit.benchmarks.bench.runner.main."""
