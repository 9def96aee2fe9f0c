"""Per-family pipelines: a typed row recipe, its data, its model configuration and its evaluation (no flags)."""
