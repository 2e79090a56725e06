"""kvtrace: record, ingest, query and view what an LLM serving engine does with its KV cache.

The package reads in data-flow order, each folder importing only those before it
(docs/architecture.md): format (the on-disk contract) -> record (the in-process recorder) -> probes
(what patches the engine) -> store (the DuckDB layout) -> ingest -> queries -> export; demo and testing
sit on top, and cli.py is the command line over them.
"""

from kvtrace.version import __version__

__all__ = ["__version__", "session"]


def session(out_dir, **options):
    """Record the vLLM engines started inside a `with kvtrace.session("run1"):` block."""
    from kvtrace.record.launch import session as _session

    return _session(out_dir, **options)
