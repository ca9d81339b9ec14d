"""Microbenchmarks and investigations: run from a checkout, never installed (see README.md)."""
