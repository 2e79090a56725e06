"""Test data for tests and benchmarks: synthetic sessions in the real shard format (synth.py)."""
