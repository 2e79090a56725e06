"""The static single-file HTML viewer and the Perfetto exporter.

    from kvtrace.export.viewer import export_html
    export_html("run1.duckdb", "run1.html")            # -> "session ...: 133 steps, 18 requests, 0.2 MB"

`export_html` runs in the exporting process: `data.build` turns the session into compact JSON (in
DuckDB SQL, aggregated or sampled to `max_events`), and this module inlines it with `viewer.js`,
`viewer.css` and `template.html` into one file that opens from disk: no server, no network. The
Content-Security-Policy allows only the inlined script and style (by hash), so even a string that got
past the escaping could not load or run anything.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.version import __version__


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def embed_json(data: Any) -> str:
    """JSON safe inside <script type="application/json">: no '<', '>' or '&' (all inside strings, so
    escaping them as \\u003c etc. keeps the JSON equal); '</script>' in a request id cannot end the element."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(data: dict[str, Any]) -> str:
    """The viewer page for data built by `kvtrace.export.viewer.data.build`."""
    js, css, template = _asset("viewer.js"), _asset("viewer.css"), _asset("template.html")
    # The inlined sources must not be able to close their own elements.
    if re.search(r"</script", js, re.I) or re.search(r"</style", css, re.I):
        raise KvtraceError("viewer assets contain a closing </script> or </style> tag")
    csp = ("default-src 'none'; script-src " + _csp_hash(js) + "; style-src " + _csp_hash(css)
           + "; img-src data:; base-uri 'none'; form-action 'none'")
    parts = {"CSP": csp, "CSS": css, "JS": js, "DATA": embed_json(data), "VERSION": __version__}
    # One pass over the template only: text put in is never scanned for placeholders again.
    return re.sub(r"\{\{(CSP|CSS|JS|DATA|VERSION)\}\}", lambda m: parts[m.group(1)], template)


def export_html(db_path: str | Path, out_path: str | Path, session: str | None = None,
                max_events: int = 1_000_000) -> str:
    """Write the viewer for one session of `db_path` to `out_path`; returns a one-line summary.

    `max_events` bounds the rows embedded (heatmap cells, block-state intervals, step details); past it
    they are aggregated or sampled in SQL and the page says so. Runs in the calling process.
    """
    from kvtrace.export.viewer import data as view_data

    t0 = time.monotonic()
    con, sid = view_data.open_session(db_path, session)
    try:
        data = view_data.build(con, sid, max_events=max_events)
    finally:
        con.close()
    html = render_html(data)
    out = Path(out_path)
    if out.parent and not out.parent.exists():
        raise KvtraceError(f"{out}: directory {out.parent} does not exist")
    out.write_text(html, encoding="utf-8")
    size = out.stat().st_size
    reduced = [n["kind"] for n in data["notices"] if n["kind"] in ("aggregated", "sampled")]
    return (f"session {sid}: {len(data['requests']['id']):,} requests, {data['meta']['counts']['steps']:,} steps, "
            f"{size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s"
            + (f"; {', '.join(sorted(set(reduced)))} to fit --max-events {max_events:,}" if reduced else ""))
