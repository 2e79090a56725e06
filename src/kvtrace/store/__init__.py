"""The DuckDB database kvtrace writes and reads: its tables and views, the keyed store behind the big
tables, and opening a database safely.

    tables.py        every table's columns as stored and as queried (the layout, in definitions only)
    keyed.py         the keyed store: process, request and label keys; rows written by hand; migrations
    layout.py        create_tables(): lays a database out, once per kvtrace version
    nsys_tables.py   the nsys_* tables and the views over them
    compression.py   column compression chosen from a table's first chunk
    db.py            open_db(): kvtrace's own databases only
    schema_doc.py    docs/schema.md, generated

Imports kvtrace.format only: ingest/ fills the database, queries/ and export/ read it.
"""

from kvtrace.store.db import open_db
from kvtrace.store.keyed import insert_rows, insert_select
from kvtrace.store.layout import create_tables
from kvtrace.store.tables import KEYED_TABLES, STORE, stored_table

__all__ = ["open_db", "create_tables", "insert_rows", "insert_select", "KEYED_TABLES", "STORE", "stored_table"]
