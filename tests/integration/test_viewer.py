"""The static HTML viewer (`kvtrace export --format html`) on exports of a real recorded run.

Data tests check what `export/viewer/data.py` embeds against the database. Browser tests (marked `browser`)
open the file from disk in headless Chromium (Debian's `chromium` package, driven by Python
`playwright`; no browser download) and check what a person sees: no console errors, every step, a
click on a step lists its requests, the heatmap draws, search finds a request, a hostile request id
stays text. Screenshots of each view are saved under artifacts/viewer/.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import shutil
from pathlib import Path

import duckdb
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.store.tables import STORE, stored_table
from tests.helpers.run import REPO, run_kvtrace
from tests.helpers.run import query as q

pytestmark = pytest.mark.vllm  # every test uses the shared recorded run

ARTIFACTS = REPO / "artifacts" / "viewer"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EVIL_ID = '"><img src=x onerror=alert(1)>'
EVIL_ID2 = "</script><script>alert(2)</script>"
EVIL_MODEL = "<img src=x onerror=alert(3)>"


def dec(col):
    return list(itertools.accumulate(col["d"])) if isinstance(col, dict) else col


def embedded_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="kvtrace-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def viewer_html(recorded_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("viewer") / "run.html"
    proc = run_kvtrace("export", str(recorded_run["db"]), "--format", "html", "-o", str(out))
    assert proc.stdout.startswith(f"wrote {out}") and "steps" in proc.stdout
    return out


# ---- the file --------------------------------------------------------------------------------------

def test_file_is_self_contained(viewer_html):
    html = viewer_html.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", html), "no URL of any kind: nothing to fetch"
    assert not re.search(r"<(link|iframe|img|object|embed)\b", html, re.I)
    assert not re.search(r"<script[^>]*\bsrc=", html, re.I)
    # The CSP allows nothing external, and only this script and this style, by hash.
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', html).group(1)
    assert csp.startswith("default-src 'none';") and "unsafe-inline" not in csp
    script = re.search(r"<script>(.*)</script>\s*</body>", html, re.S).group(1)
    style = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    for text in (script, style):
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert len(re.findall(r"</script", html, re.I)) == 2  # the data element and the code, nothing else


def test_viewer_code_has_no_html_sinks():
    """Trace strings reach the page through textContent and fillText only."""
    js = (REPO / "src" / "kvtrace" / "export" / "viewer" / "viewer.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink


def test_embedded_json_cannot_break_out():
    from kvtrace.export.viewer import embed_json

    value = {"id": EVIL_ID2 + EVIL_ID + "&amp; \u2028"}
    text = embed_json(value)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == value


def test_data_matches_database(viewer_html, recorded_run):
    db = recorded_run["db"]
    data = embedded_data(viewer_html.read_text(encoding="utf-8"))
    steps = q(db, "SELECT step, kv_blocks_used FROM steps ORDER BY t_start_ns")
    assert dec(data["steps"]["step"]) == [s for s, _ in steps]
    assert data["meta"]["counts"]["steps"] == len(steps)
    assert sorted(data["requests"]["id"]) == sorted(r for r, in q(db, "SELECT request_id FROM requests"))
    # hit:N/M badges come from prefix_lookups of that step
    hits = dict(((s), (h, qt)) for s, h, qt in q(db, "SELECT step, sum(hit_tokens), sum(query_tokens) "
                                                    "FROM prefix_lookups GROUP BY 1"))
    for i, step in enumerate(dec(data["steps"]["step"])):
        assert (data["steps"]["lh"][i], data["steps"]["lq"][i]) == hits.get(step, (0, 0))
    # Every step's requests are embedded (nothing sampled at this size).
    assert data["details"]["every"] == 1 and data["details"]["with_ids"]
    assert len(data["details"]["requests"]["req"]) == q(db, "SELECT count(*) FROM step_requests")[0][0]
    assert sum(data["details"]["blocks"]["n"]) == q(db, "SELECT count(*) FROM block_events")[0][0]
    # The heatmap sums every kv_access record.
    heat = data["heat"]
    assert heat["source"] == "kv_access" and heat["step_bin"] == 1 and heat["block_bin"] == 1
    assert sum(heat["n"]) == q(db, "SELECT count(*) FROM kv_access")[0][0]
    assert heat["layers"] == [r for r, in q(db, "SELECT DISTINCT layer FROM kv_access ORDER BY 1")]


def test_block_states_agree_with_vllm_usage(viewer_html):
    """The block states derived from block events (refcounts) give, right after each schedule(),
    exactly as many blocks in use as vLLM's own pool reported (steps.kv_blocks_used)."""
    data = embedded_data(viewer_html.read_text(encoding="utf-8"))
    s, st = data["steps"], data["states"]
    assert st["quantum_us"] == 0
    starts = dec(s["ts"])
    blk, t0, dur, state = dec(st["blk"]), st["t0"], st["dur"], st["state"]
    in_use = [(a, None if d is None else a + d) for a, d, x in zip(t0, dur, state, strict=True) if x == 1]
    assert len(set(blk)) > 1
    for i, ts in enumerate(starts):
        t = ts + s["sched"][i]
        assert sum(1 for a, b in in_use if a <= t and (b is None or b > t)) == s["kv"][i], f"step {i}"


def test_pins_show_as_held_blocks(recorded_run, tmp_path):
    """Pins (edited into a copy: the pins probe needs a pinning scheduler) mark the step and hold the
    blocks from pin to unpin; an unpin without block ids releases the blocks of the owner's pin."""
    from kvtrace.export.viewer.data import build, open_session

    db = tmp_path / "pins.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    (sid,), = con.execute("SELECT session FROM sessions").fetchall()
    (rid, fin), = con.execute("SELECT request_id, finish_ns FROM requests WHERE job_id = '0' AND turn = 0").fetchall()
    blocks = [b for b, in con.execute("SELECT DISTINCT block_id FROM block_events WHERE request_id = ? AND "
                                      "event = 'alloc' ORDER BY 1 LIMIT 3", [rid]).fetchall()]
    (step,), = con.execute("SELECT max(step) FROM steps WHERE t_start_ns <= ?", [fin]).fetchall()
    con.execute("INSERT INTO pins VALUES (?, 0, 1, ?, ?, 'pin', ?, ?, 2000000000, 'ttl-pin')",
                [sid, fin + 1000, step, rid, blocks])
    con.execute("INSERT INTO pins VALUES (?, 0, 1, ?, ?, 'unpin', ?, NULL, NULL, 'ttl-pin')",
                [sid, fin + 50_000_000, step + 5, rid])
    con.close()
    con, sid = open_session(db, None)
    try:
        data = build(con, sid)
    finally:
        con.close()
    t0 = data["meta"]["origin_monotonic_ns"]
    st = data["states"]
    ids = dec(data["heat"]["blocks"])  # the block id of each row of the view
    held = sorted((ids[b], a, d) for b, a, d, x in zip(dec(st["blk"]), st["t0"], st["dur"], st["state"], strict=True)
                  if x == 3)
    assert [b for b, _, _ in held] == blocks
    for _, a, d in held:
        assert a == round((fin + 1000 - t0) / 1000) and a + d == round((fin + 50_000_000 - t0) / 1000)
    steps = dec(data["steps"]["step"])
    assert data["steps"]["pins"][steps.index(step)] == 1 and data["pins"]["event"] == ["pin", "unpin"]


def test_budget_aggregates_and_says_so(recorded_run):
    from kvtrace.export.viewer.data import build, open_session

    con, sid = open_session(recorded_run["db"], None)
    try:
        data = build(con, sid, max_events=400)  # heatmap and states get 100 rows each, details 200
    finally:
        con.close()
    kinds = {n["kind"] for n in data["notices"]}
    assert {"aggregated", "sampled"} <= kinds
    heat = data["heat"]
    assert len(heat["n"]) <= 100 and heat["step_bin"] > 1
    assert sum(heat["n"]) == q(recorded_run["db"], "SELECT count(*) FROM kv_access")[0][0]  # summed, not lost
    assert data["details"]["every"] > 1 and not data["details"]["with_ids"]
    assert len(data["states"]["blk"]["d"]) <= 100 and data["states"]["quantum_us"] > 0
    assert len(dec(data["steps"]["step"])) == data["meta"]["counts"]["steps"]  # steps stay complete


def test_a_large_pool_shows_the_blocks_it_used(recorded_run, tmp_path):
    """vllm serve's default pool has tens of thousands of blocks, of which a run may use a few hundred:
    the view has a row for each block used (in id order), unbinned, and says so; no notice points at
    --max-events, which would change nothing."""
    from kvtrace.export.viewer.data import build, open_session

    db = tmp_path / "big-pool.duckdb"
    shutil.copy(recorded_run["db"], db)
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE steps SET kv_blocks_total = 32767")  # 32,768 blocks with the null block
        used = [b for b, in con.execute("""SELECT block_id FROM kv_access UNION SELECT block_id FROM block_events
            WHERE block_id IS NOT NULL ORDER BY 1""").fetchall()]
    con, sid = open_session(db, None)
    try:
        data = build(con, sid)
    finally:
        con.close()
    heat = data["heat"]
    assert dec(heat["blocks"]) == used and heat["rows"] == len(used) < 32768
    assert heat["block_bin"] == 1 and heat["step_bin"] == 1
    (note,) = [n["text"] for n in data["notices"] if n["text"].startswith("KV blocks view")]
    assert f"each of the {len(used):,} blocks this session used, of the pool's 32,768" in note
    assert not [n for n in data["notices"] if "--max-events" in n["text"]]
    assert max(heat["blk"]) == len(used) - 1 and max(dec(data["states"]["blk"])) <= len(used) - 1


def test_session_choice(recorded_run, tmp_path):
    from kvtrace.export.viewer import export_html

    db = tmp_path / "two.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO sessions (session, status) VALUES ('other', 'complete')")
    con.close()
    with pytest.raises(KvtraceError, match="holds 2 sessions; pick one with --session"):
        export_html(db, tmp_path / "x.html")
    with pytest.raises(KvtraceError, match="no session 'nope'"):
        export_html(db, tmp_path / "x.html", session="nope")
    sid = q(recorded_run["db"], "SELECT session FROM sessions")[0][0]
    assert export_html(db, tmp_path / "x.html", session=sid).startswith(f"session {sid}")
    proc = run_kvtrace("export", str(db), "-o", str(tmp_path / "y.html"), check=False)
    assert proc.returncode == 1 and "pick one with --session" in proc.stderr and "Traceback" not in proc.stderr


# ---- in the browser --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed "
                                   "(pip install playwright; no `playwright install` needed)")
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A viewer page with its console errors and dialogs collected."""

    def __init__(self, browser, path: Path):
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page = browser.new_page(viewport={"width": 1500, "height": 950})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", self._dialog)
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=20_000)

    def _dialog(self, d) -> None:
        self.dialogs.append(d.message)
        d.dismiss()

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / name))

    def ink(self, selector: str) -> int:
        """Pixels of a canvas that are not transparent, white or the plot background."""
        return self.page.eval_on_selector(selector, """c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) {
                const bg = (d[i] === 244 && d[i + 1] === 245 && d[i + 2] === 247) || (d[i] > 250 && d[i + 1] > 250 && d[i + 2] > 250);
                if (d[i + 3] > 0 && !bg) n++;
            }
            return n; }""")

    def colored(self, selector: str, rgb: tuple[int, int, int], tol: int = 60) -> int:
        """Pixels of a canvas near a colour (the heatmap's read/write/state colours)."""
        return self.page.eval_on_selector(selector, """(c, [r, g, b, tol]) => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4)
                if (d[i + 3] > 0 && Math.abs(d[i] - r) + Math.abs(d[i + 1] - g) + Math.abs(d[i + 2] - b) < tol) n++;
            return n; }""", [*rgb, tol])

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def page(browser, viewer_html):
    p = Page(browser, viewer_html)
    yield p
    assert not p.errors, p.errors
    p.close()


@pytest.mark.browser
def test_loads_and_shows_every_step(page, recorded_run):
    steps = [s for s, in q(recorded_run["db"], "SELECT step FROM steps ORDER BY t_start_ns")]
    assert page.page.text_content("#step-count") == f"{len(steps):,}"
    # Both time origins and the pool as the rows count it (usable blocks, as in kv:U/T).
    (t0, first, usable), = q(recorded_run["db"], "SELECT (SELECT start_monotonic_ns FROM sessions), "
                                                 "min(t_start_ns), max(kv_blocks_total) FROM steps")
    summary = page.page.text_content("#summary")
    assert "times: s since session start" in summary
    assert page.page.text_content("#origin") == f" (first step {(first - t0) / 1e9:.3f} s = query t_s 0)"
    assert f"{usable:,} usable blocks" in summary
    assert page.page.evaluate("window.kvtraceViewer.steps") == len(steps)
    assert page.ink("#steps-canvas") > 2000
    first = page.page.text_content("#steps-list .row[data-idx='0'] .c-step")
    assert first == str(steps[0])
    badges = page.page.text_content("#steps-list .row[data-idx='0'] .c-badges")
    assert re.search(r"\[prefill:\d+b\(\d+t\), \d+t total, (\d+%|–) cached, fwd:\d+t\]", badges), badges
    assert re.search(r"tok:\d+/\d+", badges) and re.search(r"hit:\d+/\d+\(\d+%\)", badges)
    page.shot("steps.png")
    page.page.eval_on_selector("#steps-list", "e => { e.scrollTop = e.scrollHeight; }")
    page.page.wait_for_selector(f"#steps-list .row[data-idx='{len(steps) - 1}']")
    assert page.page.text_content(f"#steps-list .row[data-idx='{len(steps) - 1}'] .c-step") == str(steps[-1])
    # The preemption of the standard run is marked on its step.
    (pre_step,), = q(recorded_run["db"], "SELECT min(step) FROM preemptions")
    if pre_step is not None:  # the standard workload's small pool preempts
        page.page.evaluate(f"window.kvtraceViewer.selectStep({steps.index(pre_step)})")
        assert "preempt×" in page.page.text_content("#details")


@pytest.mark.browser
def test_click_on_step_shows_its_requests(page, recorded_run):
    db = recorded_run["db"]
    steps = [s for s, in q(db, "SELECT step FROM steps ORDER BY t_start_ns")]
    (step, n), = q(db, "SELECT step, count(*) FROM step_requests GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1")
    want = sorted(r for r, in q(db, "SELECT request_id FROM step_requests WHERE step = ?", [step]))
    idx = steps.index(step)
    page.page.eval_on_selector("#steps-list", f"e => {{ e.scrollTop = {idx * 24}; }}")
    page.page.click(f"#steps-list .row[data-idx='{idx}']")
    assert page.page.text_content("#details h2") == f"Step {step}"
    got = sorted(page.page.eval_on_selector_all("#details table .rid", "els => els.map(e => e.textContent)")[:n])
    assert got == want
    blocks = page.page.text_content("#details")
    allocs = q(db, "SELECT count(*) FROM block_events WHERE step = ? AND event = 'alloc'", [step])[0][0]
    if allocs:
        assert "allocated" in blocks
    page.shot("step-details.png")
    # Long ids wrap inside the panel, words are not cut in the middle to do it.
    assert page.page.eval_on_selector("#details", "a => a.scrollWidth <= a.clientWidth")
    assert page.page.eval_on_selector_all("#details dd, #details h2", """es => es.every(e =>
        getComputedStyle(e).wordBreak === 'normal' && getComputedStyle(e).overflowWrap === 'anywhere')""")
    # The same through the timeline canvas: click the middle of another step's bar.
    other = (idx + 7) % len(steps)
    page.page.evaluate(f"window.kvtraceViewer.selectStep({other})")  # bring it into view
    x = page.page.evaluate(f"window.kvtraceViewer.stepX({other})")
    page.page.click("#steps-canvas", position={"x": x, "y": 60})
    assert page.page.text_content("#details h2") == f"Step {steps[other]}"


@pytest.mark.browser
def test_heatmap_draws_reads_writes_and_states(page):
    page.page.click(".tab[data-tab='blocks']")
    read, write = (31, 111, 209), (224, 69, 43)
    assert page.colored("#heat-canvas", read) > 1000 and page.colored("#heat-canvas", write) > 500
    assert page.ink("#usage-canvas") > 1000
    page.shot("kv-blocks-access.png")
    options = page.page.eval_on_selector_all("#layer option", "os => os.map(o => o.value)")
    assert options[0] == "-1" and len(options) >= 3  # all layers + each recorded layer
    # Hover a read cell: the tooltip counts records of all layers; with one layer chosen, of that one
    # (this model's layers read the same blocks, so exactly 1/L of them).
    x, y = page.page.eval_on_selector("#heat-canvas", """c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, dpr = window.devicePixelRatio || 1;
        for (let i = 0; i < d.length; i += 4)
            if (Math.abs(d[i] - 31) + Math.abs(d[i + 1] - 111) + Math.abs(d[i + 2] - 209) < 30) {
                const p = i / 4; return [(p % c.width) / dpr + 1, Math.floor(p / c.width) / dpr + 1]; }
        return null; }""")

    def reads_under_mouse() -> int:
        page.page.hover("#heat-canvas", position={"x": x, "y": y})
        return int(re.search(r"read (\d+)", page.page.text_content("#tooltip")).group(1))

    all_layers = reads_under_mouse()
    page.page.select_option("#layer", options[1])
    assert reads_under_mouse() * (len(options) - 1) == all_layers
    assert page.colored("#heat-canvas", read) > 500
    page.shot("kv-blocks-layer0.png")
    page.page.check("input[name='heat-mode'][value='state']")
    assert page.colored("#heat-canvas", (59, 125, 216)) > 2000  # blocks in use
    assert page.colored("#heat-canvas", (92, 184, 92)) > 100  # cached (freed, hash kept)
    page.shot("kv-blocks-states.png")


@pytest.mark.browser
def test_search_finds_a_request(page, recorded_run):
    rid = q(recorded_run["db"], "SELECT request_id FROM requests WHERE job_id = '3' AND turn = 1")[0][0]
    page.page.fill("#search", "job3-turn1")
    page.page.press("#search", "Enter")
    assert page.page.text_content("#search-count") == "1 / 1"
    assert page.page.get_attribute(".tab[data-tab='requests']", "aria-selected") == "true"
    assert page.page.text_content("#details h2") == rid
    assert page.ink("#req-canvas") > 2000
    page.shot("requests-search.png")
    page.page.fill("#search", "no-such-request")
    page.page.press("#search", "Enter")
    assert page.page.text_content("#search-count") == "0 matches"


@pytest.mark.browser
def test_zoom_and_pan(page):
    def span() -> float:
        return page.page.evaluate("window.kvtraceViewer.state.v1 - window.kvtraceViewer.state.v0")

    full = span()
    page.page.click("#zoom-in")
    assert span() == pytest.approx(full / 2)
    before = page.page.evaluate("window.kvtraceViewer.state.v0")
    page.page.keyboard.press("ArrowRight")
    assert page.page.evaluate("window.kvtraceViewer.state.v0") > before
    page.page.mouse.move(700, 200)
    page.page.hover("#steps-canvas", position={"x": 600, "y": 60})
    page.page.mouse.wheel(0, -300)
    assert span() < full / 2
    page.page.click("#zoom-reset")
    assert span() == pytest.approx(full)


@pytest.fixture(scope="module")
def hostile_db(recorded_run, tmp_path_factory) -> Path:
    """A copy of the real run whose request ids and model name were rewritten (UPDATE) into HTML and
    script; also a kernels-per-step view as Nsight ingest would make it."""
    db = tmp_path_factory.mktemp("hostile") / "hostile.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    (a,), (b,) = con.execute("SELECT request_id FROM requests ORDER BY arrival_ns LIMIT 2").fetchall()
    # The keyed tables (step_requests, batch_slots, kv_access, block_events) store a request key: their
    # ids change with the key table's.
    for table in ("requests", "request_events", "prefix_lookups", "preemptions", "pins", "transfers",
                  f"{STORE}.request_keys"):
        con.execute(f"UPDATE {stored_table(table)} SET request_id = CASE request_id WHEN ? THEN ? ELSE ? END "
                    "WHERE request_id IN (?, ?)", [a, EVIL_ID, EVIL_ID2, a, b])
    con.execute("UPDATE sessions SET model = ?", [EVIL_MODEL])
    con.execute("DROP VIEW IF EXISTS nsys_step_kernels")  # ingest makes an empty view on every database
    con.execute("""CREATE TABLE nsys_step_kernels AS SELECT session, rank, step, 'x.sqlite' AS nsys_file,
        t_end_ns - t_start_ns AS wall_ns, 12::BIGINT AS kernels, 3456789::BIGINT AS gpu_ns,
        ['flash_attn_fwd<script>', 'gemm'] AS top_names FROM steps WHERE step = 2""")
    con.close()
    return db


@pytest.mark.browser
def test_hostile_request_id_stays_text(browser, hostile_db, tmp_path):
    out = tmp_path / "hostile.html"
    run_kvtrace("export", str(hostile_db), "-o", str(out))
    html = out.read_text(encoding="utf-8")
    assert EVIL_ID not in html and "<img" not in html and len(re.findall(r"</script", html, re.I)) == 2
    p = Page(browser, out)
    try:
        assert p.page.text_content("#model").startswith(EVIL_MODEL)
        for needle, rid in (("<img", EVIL_ID), ("</script>", EVIL_ID2)):
            p.page.fill("#search", needle)
            p.page.press("#search", "Enter")
            assert p.page.text_content("#details h2") == rid  # shown as text, exactly
        p.shot("hostile-request-id.png")
        steps = [s for s, in q(hostile_db, "SELECT step FROM steps ORDER BY t_start_ns")]
        p.page.evaluate(f"window.kvtraceViewer.selectStep({steps.index(2)})")
        cells = p.page.eval_on_selector_all("#details table .rid", "els => els.map(e => e.textContent)")
        assert EVIL_ID in cells or EVIL_ID2 in cells
        assert "flash_attn_fwd<script>" in p.page.text_content("#details")  # Nsight kernels, as text
        p.page.click(".tab[data-tab='requests']")
        p.page.mouse.move(400, 400)
        p.page.wait_for_timeout(200)
        assert p.page.evaluate("document.querySelectorAll('img').length") == 0
        assert p.page.evaluate("document.scripts.length") == 2
        assert not p.dialogs and not p.errors
    finally:
        p.close()


@pytest.mark.browser
def test_reduced_export_says_so_and_draws(browser, recorded_run, tmp_path):
    out = tmp_path / "small.html"
    run_kvtrace("export", str(recorded_run["db"]), "-o", str(out), "--max-events", "1000")
    p = Page(browser, out)
    try:
        notices = p.page.text_content("#notices")
        assert "summed per" in notices and "kept for 1 step in" in notices
        p.page.click(".tab[data-tab='blocks']")
        assert p.ink("#heat-canvas") > 1000
        p.shot("kv-blocks-aggregated.png")
        assert not p.errors
    finally:
        p.close()


@pytest.mark.browser
def test_block_event_fallback_without_kv_access(browser, recorded_run, tmp_path):
    db = tmp_path / "no_access.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    con.execute(f"DELETE FROM {stored_table('kv_access')}")
    con.close()
    out = tmp_path / "no_access.html"
    run_kvtrace("export", str(db), "-o", str(out))
    assert embedded_data(out.read_text(encoding="utf-8"))["heat"]["source"] == "block_events"
    p = Page(browser, out)
    try:
        assert "No per-layer KV access records" in p.page.text_content("#notices")
        p.page.click(".tab[data-tab='blocks']")
        assert p.page.is_disabled("#layer")
        assert p.colored("#heat-canvas", (224, 69, 43)) > 200  # alloc
        assert p.colored("#heat-canvas", (46, 157, 87)) > 200  # touch (prefix hit)
        p.shot("kv-blocks-fallback.png")
        assert not p.errors
    finally:
        p.close()


@pytest.mark.browser
def test_session_without_steps(browser, recorded_run, tmp_path):
    """A session whose scheduler probe recorded nothing still exports and opens, and says why it is empty."""
    db = tmp_path / "no_steps.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    for table in ("steps", "step_requests", "kv_access"):
        con.execute(f"DELETE FROM {stored_table(table)}")
    con.close()
    out = tmp_path / "no_steps.html"
    run_kvtrace("export", str(db), "-o", str(out))
    p = Page(browser, out)
    try:
        assert p.page.text_content("#step-count") == "0"
        assert "no engine steps" in p.page.text_content("#notices")
        for tab in ("requests", "blocks", "steps"):
            p.page.click(f".tab[data-tab='{tab}']")
        assert not p.errors
    finally:
        p.close()


@pytest.mark.browser
def test_kv_blocks_view_of_a_32768_block_pool(browser, recorded_run, tmp_path):
    """A default `vllm serve` pool: 32,768 blocks, of which the run used a few dozen spread over the id
    range. The view draws a row per used block over its whole height (not a strip at the top), labels
    and hovers them with their real ids, zooms the block axis (buttons, Alt + wheel), and the colour
    legend gives every stop reason and marker its own colour."""
    db = tmp_path / "pool-32768.duckdb"
    shutil.copy(recorded_run["db"], db)
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE steps SET kv_blocks_total = 32767")
        for table in ("kv_access", "block_events"):  # ids spread over the pool, order kept
            con.execute(f"UPDATE {stored_table(table)} SET block_id = block_id * 800")
        used = [b for b, in con.execute("""SELECT block_id FROM kv_access UNION SELECT block_id FROM block_events
            WHERE block_id IS NOT NULL ORDER BY 1""").fetchall()]
    assert max(used) > 16_000 and len(used) < 200
    out = tmp_path / "pool.html"
    run_kvtrace("export", str(db), "-o", str(out))
    p = Page(browser, out)
    try:
        assert "of the pool's 32,768" in p.page.text_content("#notices")
        p.page.click(".tab[data-tab='blocks']")
        assert p.page.evaluate("window.kvtraceViewer.blockRows()") == {
            "rows": len(used), "b0": 0, "b1": len(used), "blocks": len(used)}
        read = (31, 111, 209)
        top, bottom, height = p.page.eval_on_selector("#heat-canvas", """c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let lo = c.height, hi = -1;  // rows with colour (reads, writes): not background, white or grey
            for (let i = 0; i < d.length; i += 4) {
                const grey = Math.abs(d[i] - d[i + 1]) < 16 && Math.abs(d[i + 1] - d[i + 2]) < 16;
                if (d[i + 3] > 0 && !grey) { const y = Math.floor(i / 4 / c.width); lo = Math.min(lo, y); hi = Math.max(hi, y); }
            }
            return [lo, hi, c.height]; }""")
        assert bottom - top > 0.6 * height, (top, bottom, height)  # the used rows fill the view
        p.shot("kv-blocks-32768.png")

        def hovered_block() -> int:
            x, y = p.page.eval_on_selector("#heat-canvas", """c => {
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, dpr = window.devicePixelRatio || 1;
                for (let i = d.length - 4; i >= 0; i -= 4)
                    if (Math.abs(d[i] - 31) + Math.abs(d[i + 1] - 111) + Math.abs(d[i + 2] - 209) < 30) {
                        const q = i / 4; return [(q % c.width) / dpr, Math.floor(q / c.width) / dpr]; }
                return null; }""")
            p.page.hover("#heat-canvas", position={"x": x, "y": y})
            return int(re.search(r"^block (\d+)", p.page.text_content("#tooltip")).group(1))

        assert hovered_block() in used
        p.page.click("#blocks-zoom-in")
        p.page.wait_for_timeout(100)
        zoomed = p.page.evaluate("window.kvtraceViewer.blockRows()")
        assert zoomed["b1"] - zoomed["b0"] == len(used) / 2
        assert p.colored("#heat-canvas", read) > 1000 and hovered_block() in used
        box = p.page.eval_on_selector("#heat-canvas", "c => { const r = c.getBoundingClientRect(); "
                                      "return [r.left + r.width / 2, r.top + r.height / 2]; }")
        p.page.mouse.move(*box)
        p.page.keyboard.down("Alt")
        p.page.mouse.wheel(0, -300)
        p.page.keyboard.up("Alt")
        p.page.wait_for_timeout(100)
        closer = p.page.evaluate("window.kvtraceViewer.blockRows()")
        assert closer["b1"] - closer["b0"] < zoomed["b1"] - zoomed["b0"]
        p.shot("kv-blocks-32768-zoomed.png")
        p.page.click("#blocks-zoom-reset")
        assert p.page.evaluate("window.kvtraceViewer.blockRows()")["b1"] == len(used)
        # The colour legend: one colour per entry.
        legend = p.page.eval_on_selector_all("#steps-legend > span", """ss => ss.filter(s => s.querySelector('.sw'))
            .map(s => [s.textContent, getComputedStyle(s.querySelector('.sw')).backgroundColor])""")
        names = [n for n, _ in legend]
        assert {"stop: kv-insuf", "stop: max-seqs", "stop: preempted · preemption ▼", "pin ◆"} <= set(names), names
        assert len({c for _, c in legend}) == len(legend), legend
        assert not p.errors, p.errors
    finally:
        p.close()
