"""The checkpoint formats: one module each, ending with its `FORMAT` record."""
