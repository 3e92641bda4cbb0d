"""Handlers with a known behaviour, used to check the benchmark harness against known answers."""
