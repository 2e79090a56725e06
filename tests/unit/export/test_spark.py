"""The Parquet dataset read by Apache Spark (local mode here; the same code on a cluster): the tables as
temp views, and `summary` plus per-session aggregations giving DuckDB's numbers on the same data."""

from __future__ import annotations

import math
import shutil

import pytest

from kvtrace.errors import KvtraceError
from kvtrace.export.dataset import export_parquet, open_dataset
from kvtrace.queries import run_query, run_sql
from kvtrace.testing import synth

pytestmark = pytest.mark.spark


def _spark_missing() -> str | None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (pip install -e '.[spark]')"
    if shutil.which("java") is None:
        return "no java on PATH (Spark needs Java 17+)"
    return None


@pytest.fixture(scope="module")
def spark():
    reason = _spark_missing()
    if reason:
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("kvtrace-tests")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "1").config("spark.driver.memory", "1g")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark")
    dirs = [synth.generate(tmp / f"s{i}", 10_000 + 7_000 * i, seed=40 + i)["dir"] for i in range(4)]
    dirs.append(synth.generate(tmp / "odd", 4_000, seed=9, session_id="20261122")["dir"])  # digits: a string
    export_parquet(dirs, tmp / "ds")
    return tmp / "ds"


def close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def test_spark_reads_the_dataset_and_agrees_with_duckdb(spark, dataset):
    from kvtrace.queries.spark import PORTABLE, register_dataset
    from kvtrace.queries.spark import run_query as spark_query

    views = register_dataset(spark, str(dataset))
    assert {"steps", "sessions", "prefix_lookups", "preemptions", "kv_access", "transfers"} <= set(views)
    assert dict(spark.table("steps").dtypes)["session"] == "string"
    assert spark.table("transfers").count() == 0  # no session has rows: an empty, typed view
    con = open_dataset(dataset)
    try:
        for name in ["summary", *PORTABLE]:
            s_cols, s_rows = spark_query(spark, name)
            d_cols, d_rows = run_query(con, name) if name == "summary" else run_sql(con, PORTABLE[name])
            assert s_cols == d_cols, name
            assert len(s_rows) == len(d_rows) and (name == "preemptions_by_session" or len(d_rows) == 5), name
            for s, d in zip(s_rows, d_rows, strict=True):
                assert all(close(a, b) for a, b in zip(s, d, strict=True)), (name, s, d)
        # Numbers that matter, not just agreement: every session has steps and lookups.
        cols, rows = spark_query(spark, "summary", session="20261122")
        assert len(rows) == 1
        row = dict(zip(cols, rows[0]))
        assert row["steps"] > 0 and row["prefix_query_tokens"] > 0
    finally:
        con.close()


def test_spark_errors(spark, tmp_path):
    from kvtrace.queries.spark import register_dataset
    from kvtrace.queries.spark import run_query as spark_query

    with pytest.raises(KvtraceError, match="not a kvtrace dataset"):
        register_dataset(spark, str(tmp_path))
    with pytest.raises(KvtraceError, match="no Spark version"):
        spark_query(spark, "turn_latency")
