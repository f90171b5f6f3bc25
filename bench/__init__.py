"""Benchmarks (never part of the test suite): each prints a table and writes JSON."""
