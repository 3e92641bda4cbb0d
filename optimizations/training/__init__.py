"""Training code (speculator heads): never imported by the serving path."""
