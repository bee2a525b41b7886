"""Benchmarks, run as modules from the repository root (`python -m bench.bench_core`; see the Makefile)."""
