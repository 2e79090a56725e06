"""A kvtrace Parquet dataset in Apache Spark: the tables as temp views, and queries in Spark SQL.

    from pyspark.sql import SparkSession
    from kvtrace.queries.spark import register_dataset, run_query

    spark = SparkSession.builder.getOrCreate()
    register_dataset(spark, "s3a://bucket/kvtrace-dataset")   # or a local/HDFS path
    columns, rows = run_query(spark, "summary")

The same code runs in local mode and on a cluster: the Parquet files go through Spark's reader, the
description file through Hadoop's FileSystem when the path is not local. Needs the `spark` extra (`pip install kvtrace[spark]`)
and Java 17+. `summary` is the canned DuckDB query rewritten for Spark SQL (an aggregate per table
joined to `sessions`, `string_agg` as a sorted `collect_set`); the `PORTABLE` queries are plain SQL that DuckDB
(`kvtrace.export.dataset.open_dataset`) and Spark both run unchanged, and that return the same numbers.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.format import schema

META = "_kvtrace_dataset.json"

# DuckDB column types of the dataset -> Spark SQL types (for empty tables and missing columns).
SPARK_TYPES = {"BIGINT": "BIGINT", "INTEGER": "INT", "SMALLINT": "SMALLINT", "TINYINT": "TINYINT",
               "DOUBLE": "DOUBLE", "FLOAT": "FLOAT", "BOOLEAN": "BOOLEAN", "VARCHAR": "STRING",
               "JSON": "STRING", "INTEGER[]": "ARRAY<INT>", "BIGINT[]": "ARRAY<BIGINT>",
               "VARCHAR[]": "ARRAY<STRING>", "TIMESTAMP": "TIMESTAMP", "DATE": "DATE"}

# queries/summary.sql for Spark: the same columns and numbers, with one aggregate per table joined to
# `sessions` (Spark plans the canned query's 14 correlated subqueries as many more stages).
SUMMARY_SQL = """
WITH st AS (SELECT session, count(*) AS n, min(t_start_ns) AS t0, max(t_end_ns) AS t1 FROM steps GROUP BY session),
     rq AS (SELECT session, count(*) AS n, sum(output_tokens) AS o FROM requests GROUP BY session),
     pe AS (SELECT session, count(*) AS n FROM preemptions GROUP BY session),
     pl AS (SELECT session, sum(query_tokens) AS q, sum(hit_tokens) AS h FROM prefix_lookups
            WHERE after_preemption = 0 GROUP BY session),
     be AS (SELECT session, sum(CASE WHEN event = 'alloc' THEN 1 ELSE 0 END) AS allocs,
                   sum(CASE WHEN event = 'free' THEN 1 ELSE 0 END) AS frees,
                   sum(CASE WHEN event = 'evict' THEN 1 ELSE 0 END) AS evictions
            FROM block_events GROUP BY session),
     ka AS (SELECT session, count(*) AS n FROM kv_access GROUP BY session),
     dr AS (SELECT session, sum(dropped) AS n FROM drops GROUP BY session),
     pr AS (SELECT session, concat_ws(', ', sort_array(collect_set(concat(probe, ':', status)))) AS names
            FROM probes WHERE status NOT IN {PROBE_FINE_SQL} GROUP BY session),
     ii AS (SELECT session, concat_ws('; ', transform(sort_array(collect_list(struct(file, problem))), x -> x.problem))
                AS problems
            FROM ingest_issues GROUP BY session)
SELECT
    s.session,
    s.status,
    coalesce(st.n, 0) AS steps,
    coalesce(rq.n, 0) AS requests,
    coalesce(rq.o, 0) AS output_tokens,
    coalesce(pe.n, 0) AS preemptions,
    coalesce(pl.q, 0) AS prefix_query_tokens,
    coalesce(pl.h, 0) AS prefix_hit_tokens,
    round(pl.h / nullif(pl.q, 0), 4) AS prefix_hit_rate,
    coalesce(be.allocs, 0) AS block_allocs,
    coalesce(be.frees, 0) AS block_frees,
    coalesce(be.evictions, 0) AS block_evictions,
    coalesce(ka.n, 0) AS kv_access_records,
    coalesce(dr.n, 0) AS dropped_events,
    pr.names AS probes_disabled,
    round((st.t1 - st.t0) / 1e9, 3) AS duration_s,
    ii.problems AS problems
FROM sessions s
LEFT JOIN st ON st.session = s.session
LEFT JOIN rq ON rq.session = s.session
LEFT JOIN pe ON pe.session = s.session
LEFT JOIN pl ON pl.session = s.session
LEFT JOIN be ON be.session = s.session
LEFT JOIN ka ON ka.session = s.session
LEFT JOIN dr ON dr.session = s.session
LEFT JOIN pr ON pr.session = s.session
LEFT JOIN ii ON ii.session = s.session
{where}
ORDER BY s.session
"""

# Plain SQL both engines run unchanged (tests compare them on the same dataset).
PORTABLE = {
    "prefix_cache_by_session": """
SELECT session,
       count(*) AS lookups,
       sum(query_tokens) AS query_tokens,
       sum(hit_tokens) AS hit_tokens,
       sum(hit_tokens) / nullif(sum(query_tokens), 0) AS hit_rate,
       sum(CASE WHEN hit_tokens > 0 THEN 1 ELSE 0 END) AS lookups_with_hits
FROM prefix_lookups
WHERE after_preemption = 0
GROUP BY session
ORDER BY session""",
    "preemptions_by_session": """
SELECT session,
       count(*) AS preemptions,
       count(DISTINCT request_id) AS requests_preempted,
       sum(computed_tokens_lost) AS computed_tokens_lost,
       sum(blocks_freed) AS blocks_freed
FROM preemptions
GROUP BY session
ORDER BY session""",
}


def read_meta(spark, path: str) -> dict[str, Any]:
    """The dataset's description: read directly for a local path, through Hadoop's FileSystem (the
    driver's JVM) for s3a://, hdfs://, ... Spark's own file readers skip names starting with `_`."""
    file = f"{path.rstrip('/')}/{META}"
    try:
        if "://" not in path or path.startswith("file://"):
            with open(file.removeprefix("file://")) as f:
                text = f.read()
        else:
            jvm = spark.sparkContext._jvm
            hpath = jvm.org.apache.hadoop.fs.Path(file)
            stream = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).open(hpath)
            try:
                text = jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
            finally:
                stream.close()
        meta = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:
        raise KvtraceError(f"{path}: not a kvtrace dataset (cannot read {META}: {str(exc)[:200]})") from None
    except Exception as exc:  # Py4JJavaError: FileNotFoundException and the like
        raise KvtraceError(f"{path}: not a kvtrace dataset (cannot read {META}: "
                           f"{str(exc).splitlines()[0][:160]})") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise KvtraceError(f"{file}: not a kvtrace dataset description")
    if meta["schema_version"] > schema.SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {meta['schema_version']} is newer than this kvtrace "
                           f"reads ({schema.SCHEMA_VERSION}); upgrade kvtrace")
    return meta


def register_dataset(spark, path: str, prefix: str = "") -> list[str]:
    """Register every table of the dataset at `path` as a Spark temp view (named `prefix` + table);
    returns the view names. `session` is a string column (partition type inference is switched off
    for this, so an id such as `20261122` stays a string)."""
    from pyspark.sql import functions as F

    meta = read_meta(spark, path)
    spark.conf.set("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    names = []
    for table, info in sorted(meta.get("tables", {}).items()):
        columns = [(c, SPARK_TYPES.get(t.upper(), "STRING")) for c, t in info.get("columns", [])]
        ddl = ", ".join(f"`{c}` {t}" for c, t in columns)
        base = f"{path.rstrip('/')}/table={table}"
        try:
            # The schema is given (no inference job per table; a column older files lack reads as
            # NULL); `session` comes from the folder names, as a string.
            df = spark.read.schema(ddl).option("basePath", base).parquet(base)
        except Exception as exc:  # AnalysisException: no session has rows in this table
            if "PATH_NOT_FOUND" not in str(exc) and "does not exist" not in str(exc):
                raise
            df = spark.createDataFrame([], ddl)
        df = df.select(*[F.col(f"`{c}`") for c, _ in columns])  # the database's column order
        view = f"{prefix}{table}"
        df.createOrReplaceTempView(view)
        names.append(view)
    return names


def summary_sql(session: str | None = None) -> str:
    where = "" if session is None else "WHERE s.session = '" + session.replace("'", "''") + "'"
    return SUMMARY_SQL.format(where=where, PROBE_FINE_SQL=schema.PROBE_FINE_SQL)


def run_query(spark, name: str, session: str | None = None) -> tuple[list[str], list[tuple]]:
    """Run `summary` or a `PORTABLE` query on the registered views; returns (columns, rows)."""
    if name == "summary":
        sql = summary_sql(session)
    elif name in PORTABLE:
        sql = PORTABLE[name]
    else:
        raise KvtraceError(f"no Spark version of query {name!r} (have: summary, {', '.join(PORTABLE)})")
    df = spark.sql(sql)
    return list(df.columns), [tuple(r) for r in df.collect()]
