"""Console entry points (these may print; the library logs)."""
