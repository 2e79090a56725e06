"""docs/schema.md: the shard tables (kvtrace.format.schema) and what the database adds to them.

    python -m kvtrace.store.schema_doc > docs/schema.md      (make schema-doc)
"""

from __future__ import annotations

from kvtrace.format import schema
from kvtrace.store.tables import DERIVED_MEANINGS, KEYED_TABLES, SESSION_TABLES, STORE


def markdown() -> str:
    """docs/schema.md's part on what the DuckDB database (and the Parquet dataset) holds beyond the shard
    tables: appended by `python -m kvtrace.format.schema`."""
    out = ["", "# In the database", "",
           "Ingest loads each shard table above into a DuckDB table of the same name, with the process "
           "columns first, except the three run tables: `decode_runs` and `batch_slot_runs`, whose runs it "
           "expands into the `step_requests` and `batch_slots` rows they stand for, and `kv_access_records`, whose packed records it decodes "
           "into `kv_access` rows (and writes again for each layer its `layer_copies` names). Three differ:", "",
           "- `block_events` (and `offload_block_events`, alike) has one row per block: `block_ids` / `block_hashes` become `block_id` INTEGER "
           "and `block_hash` BIGINT (null where the call had no hashes). A trailing `seq` BIGINT numbers the "
           "process's calls in recording order (the rows of one call share it; in a database converted from "
           "an older kvtrace, each row has its own): order by (ts_ns, seq) for the events of a block that "
           "share a timestamp, such as the evict and the alloc of one call.",
           "- `kv_access` has a trailing `request_id` VARCHAR, taken from the worker's `batch_slots` "
           "(same pid, step and slot).", "",
           f"The big tables ({', '.join(f'`{t}`' for t in KEYED_TABLES)}) are views with the same "
           f"columns: their rows are stored in `{STORE}.<table>` with keys in place of values that repeat "
           f"on every row, which the view joins back: a `proc` INTEGER for the process columns "
           f"(`{STORE}.proc_keys`: proc, session, rank, pid), a `request_key` INTEGER for `request_id` in "
           f"all of them but layer_timings (`{STORE}.request_keys`: request_key, session, request_id; key "
           f"0 is the null id), and UTINYINT codes for the labels `phase` and `kind` of step_requests and "
           f"`event` of block_events (`{STORE}.labels`: label, text). Read them as tables; change rows "
           "(UPDATE, DELETE) in the stored table, and request ids in the key table. A database written by "
           "an older kvtrace, with plain tables there or text in place of the request and label keys "
           "(kv_access and block_events kept their request ids as text until 2026-11-23), is converted on "
           "its next ingest. The stored tables' columns declare their compression (`USING COMPRESSION "
           "rle` or `bitpacking`), chosen when a table gets its first chunk of at least a row group "
           "(122,880 rows) in the database: DuckDB's own size estimates over that chunk, which spares "
           "DuckDB estimating every segment again (store/compression.py); smaller tables keep DuckDB's "
           "choice per segment.", "",
           "It derives these tables per session. The Parquet dataset (docs/dataset.md) has the same "
           "tables and columns; Nsight Systems tables are in docs/nsys.md."]
    for table, cols in SESSION_TABLES.items():
        out += ["", f"## {table}", "", "| column | type | meaning |", "|---|---|---|"]
        for col in cols.split(","):
            name, type_ = col.split()
            out.append(f"| {name} | {type_} | {DERIVED_MEANINGS[table].get(name, '')} |")
    return "\n".join(out) + "\n"


def schema_markdown() -> str:
    """The whole of docs/schema.md: the shard tables, then the database's."""
    return schema.markdown() + markdown()


if __name__ == "__main__":
    print(schema_markdown(), end="")
