"""The LLM engine: generation, continuous batching, sampling, speculation, chat template, and the LLM plan."""
