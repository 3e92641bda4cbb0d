"""TorchServe handler entry points (the only servekit code that imports `ts`) and their helpers."""
