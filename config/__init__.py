"""Package data: TorchServe config.properties, metrics.yaml and the model-configs in models/."""
