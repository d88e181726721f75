"""generators: arrives with its own issue (see docs/architecture.md)."""
