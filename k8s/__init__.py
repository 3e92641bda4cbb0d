"""Package data: Kustomize base, overlays, monitoring (rules, dashboards) and components."""
