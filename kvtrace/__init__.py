"""kvtrace: record, ingest, query and view what an LLM serving engine does with its KV cache."""

__version__ = "0.1.0"
