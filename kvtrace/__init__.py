"""kvtrace: record, ingest, query and view what an LLM serving engine does with its KV cache."""

__version__ = "0.1.0"


def session(out_dir, **options):
    """Record the vLLM engines started inside a `with kvtrace.session("run1"):` block."""
    from kvtrace.record import session as _session

    return _session(out_dir, **options)
