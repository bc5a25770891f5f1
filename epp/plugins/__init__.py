"""Plugin implementations, one module per plugin type or family (``epp.plugin_types`` imports
them all, which registers them)."""
