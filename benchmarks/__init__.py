"""The auto-benchmark (bench/) and benchmark scripts; results of GPU runs in results/."""
