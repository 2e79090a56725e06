"""Pin adapter: how a pinning scheduler (EngineCore) tells kvtrace what KV it keeps, and for how long.

A scheduler that keeps a finished request's KV against eviction (Continuum keeps a finished turn's KV
for a TTL, until the job's next turn arrives) calls these functions; each appends one `pins` row:

    from kvtrace.probes import pins
    pins.report_pin(request_id, block_ids, ttl_ns, reason="ttl-pin")   # KV kept from now on
    pins.report_reuse(request_id, block_ids, reason="ttl-pin")        # a new request hit the kept KV
    pins.report_unpin(request_id, block_ids, reason="ttl-pin")        # released by the policy
    pins.report_expire(request_id, block_ids, ttl_ns, reason="ttl-pin")  # released: the TTL ran out

`request_id` is the request whose KV is pinned (for reuse too: the owner, not the request that hit it;
`block_events` touch rows of the same step name the hitting request). Blocks are physical block ids,
ttl_ns the pin's time-to-live in ns (None when the policy has none), `step` defaults to the engine step
being scheduled or finished (kvtrace's scheduler probe keeps it). Every function is a no-op costing a
few lookups when the process is not being recorded (`KVTRACE_SESSION` unset) or the session was
recorded with `pins` disabled, and none of them raises: a pinning scheduler can call them
unconditionally. See docs/pins.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvtrace.record.context import ctx

_buffer: list | None = None
_checked: tuple = (-1, None)  # (pid, recorder) the buffer was looked up for


def _pins_buffer() -> list | None:
    """The recorder's `pins` buffer in this process, or None when not recording (looked up again only
    when the process or its recorder changes: a fork, or a replay writing its own session)."""
    global _buffer, _checked
    import os

    try:
        from kvtrace.record import recorder as _rec_mod

        key = (os.getpid(), _rec_mod.current_recorder())
        if _checked == key and (key[1] is not None or not os.environ.get("KVTRACE_SESSION")):
            return _buffer
        rec = _rec_mod.get_recorder()
        _checked, _buffer = (os.getpid(), rec), None
        if rec is not None and "pins" not in set(rec.options.get("disable_probes", ())):
            _buffer = rec.buffer("pins")
    except Exception:
        _buffer = None
    return _buffer


def _report(event: str, request_id: str, block_ids: Iterable[int] | None, ttl_ns: int | None,
            reason: str | None, step: int | None) -> None:
    buf = _pins_buffer()
    if buf is None:
        return
    try:
        blocks = None if block_ids is None else [int(b) for b in block_ids]
        buf.append((time.monotonic_ns(), ctx.step if step is None else int(step), event, str(request_id),
                    blocks, None if ttl_ns is None else int(ttl_ns), reason))
    except Exception:  # a bad argument must not take the scheduler down
        pass


def report_pin(request_id: str, block_ids: Iterable[int], ttl_ns: int | None = None,
               reason: str = "pin", step: int | None = None) -> None:
    """The policy starts keeping these blocks of `request_id` (typically when it finishes)."""
    _report("pin", request_id, block_ids, ttl_ns, reason, step)


def report_unpin(request_id: str, block_ids: Iterable[int] | None = None, reason: str = "pin",
                 step: int | None = None) -> None:
    """The policy released the pin before its TTL (e.g. the next turn now owns the blocks)."""
    _report("unpin", request_id, block_ids, None, reason, step)


def report_expire(request_id: str, block_ids: Iterable[int] | None = None, ttl_ns: int | None = None,
                  reason: str = "pin", step: int | None = None) -> None:
    """The pin's TTL ran out without the KV being reused; the blocks go back to the pool."""
    _report("expire", request_id, block_ids, ttl_ns, reason, step)


def report_reuse(request_id: str, block_ids: Iterable[int], reason: str = "pin",
                 step: int | None = None) -> None:
    """A newly scheduled request hit these pinned blocks of `request_id` in the prefix cache."""
    _report("reuse", request_id, block_ids, None, reason, step)


def _reset_for_tests() -> None:
    global _buffer, _checked
    _buffer, _checked = None, (-1, None)
