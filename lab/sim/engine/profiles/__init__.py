"""Shipped engine profiles (YAML), loaded by name with ``sim.engine.load_profile``."""
