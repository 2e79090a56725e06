"""The command line itself: every command has help with an example and is in the README; errors are
one line; canned queries all carry their header and are listed and documented."""

from __future__ import annotations

import json
import re

import pytest

from kvtrace.cli import cli
from kvtrace.queries import all_queries
from tests.helpers.run import REPO, run_kvtrace

COMMANDS = sorted(cli.commands)


def test_commands_exist():
    assert {"record", "ingest", "query", "export", "demo", "report", "compare"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_an_example_and_readme_mentions_it(command):
    out = run_kvtrace(command, "--help").stdout
    assert out.startswith("Usage: kvtrace " + command)
    assert re.search(rf"^\s+kvtrace {command}\b", out, re.M), f"no example in `kvtrace {command} --help`"
    assert f"kvtrace {command}" in (REPO / "README.md").read_text()


def test_record_flushes_at_the_recorders_default_interval():
    """`kvtrace record --flush-interval` defaults to the recorder's own default (the CLI writes it out
    rather than importing the recorder, which loads pyarrow)."""
    from kvtrace.record.recorder import FLUSH_INTERVAL_S

    (option,) = [p for p in cli.commands["record"].params if p.name == "flush_interval"]
    assert option.default == FLUSH_INTERVAL_S


def test_top_level_help_and_version():
    assert "record" in run_kvtrace("--help").stdout
    assert run_kvtrace("--version").stdout.strip().startswith("kvtrace, version")


def test_every_canned_query_is_listed_and_documented():
    listed = run_kvtrace("query", "--list").stdout
    docs = (REPO / "docs" / "queries.md").read_text() + (REPO / "docs" / "nsys.md").read_text()
    files = sorted(p.stem for p in (REPO / "src" / "kvtrace" / "queries").glob("*.sql"))
    assert sorted(all_queries()) == files  # the header name is the file name
    for name, q in all_queries().items():
        assert q.description and q.columns, name
        assert re.search(rf"^{name}\s", listed, re.M), name
        assert name in docs, f"{name} has no section in docs/queries.md or docs/nsys.md"


@pytest.mark.parametrize("args, needle", [
    (["query", "/no/such.duckdb", "summary"], "no such database"),
    (["ingest", "/no/such/session", "-o", "/tmp/x-kvtrace-cli.duckdb"], "no such session directory"),
    (["query", "--list", "--sql", "select"], None),
    (["record"], "Missing argument"),
    (["record", "-o", "/tmp/kvtrace-cli-nocmd", "--", "kvtrace-no-such-command-xyz"], "command not found"),
    (["record", "--kv-ring-capacity", "1000", "-o", "/tmp/kvtrace-cli-ring", "--", "true"], "not a power of two"),
    (["export", "/no/such.duckdb", "-o", "/tmp/x.html"], "no such database"),
    (["export", "/no/such.duckdb", "-o", "/tmp/kvtrace-cli-out.txt"], "cannot tell the format"),
])
def test_errors_are_one_line(args, needle, tmp_path):
    proc = run_kvtrace(*args, check=False)
    if needle is None:
        assert proc.returncode == 0
        return
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert needle in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("kvtrace: error") or "Error" in ln]) == 1


def test_schema_doc_is_generated_from_code():
    """docs/schema.md is exactly what `python -m kvtrace.store.schema_doc` prints (shard tables, then what
    ingest derives): a hand edit, or a change to either part not regenerated, fails here."""
    from kvtrace.store.schema_doc import schema_markdown

    doc = (REPO / "docs" / "schema.md").read_text()
    assert doc == schema_markdown(), "regenerate: make schema-doc"


def test_query_output_is_streamed_in_chunks_with_the_same_text():
    """`kvtrace query` writes csv and json chunk by chunk (a big result is never held whole): the text
    is exactly what one dump of all rows gives, whatever the chunking."""
    import contextlib
    import csv
    import io

    from kvtrace.cli import _print_chunks

    cols = ["a", "b", "c"]
    rows = [(1, "x\ny", None), (2.5, 'q"uote', [1, 2]), (3, "é", True)]
    for chunks in ([rows], [rows[:1], [], rows[1:]], [[]], []):
        all_rows = [r for c in chunks for r in c]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _print_chunks(cols, iter(chunks), "json")
        assert buf.getvalue() == json.dumps([dict(zip(cols, r)) for r in all_rows], default=str, indent=1) + "\n"
        buf, want = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf):
            _print_chunks(cols, iter(chunks), "csv")
        w = csv.writer(want)
        w.writerow(cols)
        w.writerows(all_rows)
        assert buf.getvalue() == want.getvalue()


def test_query_table_output_pads_every_column_to_its_widest_cell(capsys):
    """The table format: header, dashes, then each row with every cell padded to its column's widest
    cell (header included), floats to 6 significant digits, None as blank; rows from every chunk."""
    from kvtrace.cli import _print_chunks

    rows = [(1, "x", None), (2.123456789, "longer cell", 7)]
    _print_chunks(["a", "b", "wide_header"], iter([rows[:1], [], rows[1:]]), "table")
    assert capsys.readouterr().out.splitlines() == [
        "a        b            wide_header",
        "-------  -----------  -----------",
        "1        x                       ",
        "2.12346  longer cell  7          ",
    ]
    _print_chunks(["only"], iter([]), "table")
    assert capsys.readouterr().out.splitlines() == ["only", "----"]


def test_a_query_with_no_rows_says_why_on_stderr(tmp_path):
    """stdout stays the (empty) result, so pipes still parse it; stderr says what the query needs."""
    import duckdb

    from kvtrace.store.layout import create_tables

    db = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(db))
    create_tables(con)
    con.close()
    out = run_kvtrace("query", str(db), "turn_latency", "--format", "json")
    assert json.loads(out.stdout) == []
    assert "turn_latency: no rows: needs job/turn ids" in out.stderr and "--job-pattern" in out.stderr
    out = run_kvtrace("query", str(db), "kernel_summary")
    assert out.stdout.startswith("time_pct") and "--nsys" in out.stderr
    out = run_kvtrace("query", str(db), "--sql", "select 1 as x where false")
    assert out.stderr == ""  # SQL of the user's own: no rows is an answer


def test_table_output_escapes_control_characters_and_session_ids_stay_text(tmp_path):
    import duckdb

    from kvtrace.store.layout import create_tables

    db = tmp_path / "t.duckdb"
    con = duckdb.connect(str(db))
    create_tables(con)
    con.close()
    out = run_kvtrace("query", str(db), "--sql", "select 'job' || chr(27) || ']0;pwned' || chr(7) || 'x' as rid")
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "job\\x1b]0;pwned\\x07x" in out.stdout
    # json keeps the exact value (escaped by JSON itself)
    out = run_kvtrace("query", str(db), "--sql", "select chr(27) as c", "--format", "json")
    assert json.loads(out.stdout) == [{"c": "\x1b"}]
    out = run_kvtrace("query", str(db), "--sql", "select $session as s, typeof($session) as t",
                      "-p", "session=12345", "--format", "json")
    assert json.loads(out.stdout) == [{"s": "12345", "t": "VARCHAR"}]
