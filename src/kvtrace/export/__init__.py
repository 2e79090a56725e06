"""What kvtrace writes from a database for people and other tools.

    viewer/      the single-file offline HTML viewer
    perfetto.py  Perfetto / Chrome trace JSON
    report.py    figures (PNG + SVG) with an index page, and `compare` of several sessions
    dataset.py   the Parquet dataset (one folder, many sessions; Spark and DuckDB read it)
"""
