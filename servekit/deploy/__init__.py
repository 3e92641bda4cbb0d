"""Deploy tools: a Kubernetes overlay from a benchmark recommendation, Grafana dashboards."""
