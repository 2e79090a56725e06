"""pyarrow's one-time pandas check, moved off an ingest's critical path (`kvtrace ingest` and the CLI)."""

from __future__ import annotations

import threading

import pyarrow as pa

_pyarrow_settled = False  # settle_pyarrow_without_pandas ran: pyarrow has made its pandas check


def warm_up_pyarrow() -> None:
    """Let pyarrow import pandas in a helper thread now, instead of on the first `pa.array()` call.

    pyarrow imports pandas (if installed) the first time it converts Python or NumPy values, to check
    for pandas inputs: ~0.45 s of CPU on this project's machines, which an ingest otherwise spends in
    its main thread while DuckDB waits for the first chunk (10% of bench_scale's 10 M-event ingest).
    Started before the database is opened and its tables made, it runs beside them. Nothing is done
    when pandas is imported already or not installed, or after `settle_pyarrow_without_pandas`."""
    import importlib.util
    import sys

    if _pyarrow_settled or "pandas" in sys.modules or importlib.util.find_spec("pandas") is None:
        return

    def convert_once() -> None:
        try:
            pa.array([0])
        except Exception:  # only a warm-up: the real call will say what is wrong
            pass

    threading.Thread(target=convert_once, daemon=True, name="kvtrace-pyarrow-warm-up").start()


def settle_pyarrow_without_pandas() -> None:
    """Have pyarrow conclude, without importing it, that pandas is not there: for a process that will
    not use pandas (`kvtrace ingest`). Saves the ~0.45 CPU-s import that `warm_up_pyarrow` only moves to
    another thread: a fifth of the CPU of a 1 M-event `kvtrace ingest`, which stores no pandas object.

    pyarrow checks for pandas once, on its first conversion of Python or NumPy values. Here that check
    meets an ImportError, so pyarrow stops looking for pandas inputs; its explicit pandas calls
    (`to_pandas()`) still import pandas when they run. Nothing is done when pandas is imported already
    or pyarrow has checked."""
    import importlib.abc
    import sys

    if "pandas" in sys.modules:
        return

    class NoPandas(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "pandas" or name.startswith("pandas."):
                raise ImportError(f"{name}: not imported for this kvtrace command")
            return None

    finder = NoPandas()
    sys.meta_path.insert(0, finder)
    try:
        pa.array([0])
    except Exception:  # only a settling: the real conversions will say what is wrong
        pass
    finally:
        sys.meta_path.remove(finder)
    global _pyarrow_settled
    _pyarrow_settled = True
