"""Ingest: session shards and Nsight Systems exports into one DuckDB database."""
