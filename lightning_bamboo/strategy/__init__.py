"""strategy."""
