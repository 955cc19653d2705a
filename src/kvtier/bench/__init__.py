"""Benchmarks, each against its physical baseline in the same run (``kvtier bench NAME``)."""
