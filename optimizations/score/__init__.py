"""Cross-encoder and sequence-classifier runtime (rerank, score, classify)."""
