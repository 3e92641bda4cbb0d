"""servekit's harness: TorchServe server adapter, auto-benchmark, demo and CLI."""
