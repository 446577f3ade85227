"""Benchmarks run by hand (not part of the test suite): ``python -m loopwatch.bench.nab_score``."""
