"""The on-disk contract: what a recording session is made of, written by record/ and read by ingest/.

    schema.py    every shard table's columns, types and units (the single source of the schema)
    session.py   the session directory: manifest.json, procs/<host>-<pid>/proc.json, SessionDir
    shards.py    Arrow IPC stream shards: the writer (recording processes) and the reader (ingest)

Imports nothing of kvtrace but errors and version: any tool may read a session through it.
"""
