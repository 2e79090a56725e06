"""probes/imports.py: a probe can wait for a module instead of importing it (no vLLM needed)."""

from __future__ import annotations

import sys

from kvtrace.probes.imports import when_imported


def test_callback_runs_after_the_module_body_once(tmp_path, monkeypatch):
    (tmp_path / "kvt_late_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    assert when_imported("kvt_late_mod", lambda m: seen.append(m.VALUE))
    assert seen == [] and "kvt_late_mod" not in sys.modules  # asking did not import it
    import kvt_late_mod  # noqa: F401

    assert seen == [42]
    when_imported("kvt_late_mod", lambda m: seen.append(-m.VALUE))  # already imported: at once
    assert seen == [42, -42]
    sys.modules.pop("kvt_late_mod", None)


def test_a_module_that_does_not_exist_is_reported():
    calls = []
    assert not when_imported("kvt_no_such_module_here", calls.append)
    assert not when_imported("kvt_no_such_pkg.sub", calls.append)
    assert calls == []


def test_a_failing_callback_never_breaks_the_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "kvt_late_mod2.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def boom(_module):
        raise RuntimeError("probe bug")

    assert when_imported("kvt_late_mod2", boom)
    import kvt_late_mod2

    assert kvt_late_mod2.VALUE == 7
    assert "probe bug" in capsys.readouterr().err
    sys.modules.pop("kvt_late_mod2", None)
