"""In-flight load the EPP itself has put on each endpoint, counted in tokens."""
