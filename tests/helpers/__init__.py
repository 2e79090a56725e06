"""Helpers shared by the tests (and by some benchmarks): running kvtrace, driving vLLM, test data."""
