"""NVTX ranges and clock marks for Nsight Systems, in NVTX domain `kvtrace` (EngineCore and workers).

Under `nsys profile` these put our engine steps on nsys's timeline:

- a range per engine step, `kvtrace step 1234` (`push_step` ... `pop`), and its phases
  `kvtrace schedule`, `kvtrace execute`, `kvtrace update` (`phase("schedule")`, or `push_phase`/`pop`);
- optionally a range per model layer, `kvtrace layer 7` (`layer(7)`; on with KVTRACE_NVTX_LAYERS=1);
- a mark per step, `kvtrace:step=<step>:mono_ns=<time.monotonic_ns()>`, emitted by `push_step` just
  before the step's range: our step id and our own clock reading next to nsys's timestamp, from which
  ingest aligns the export to our clock exactly (ingest/nsys_align.py).

Off (each function is one test of a module global) when the `nvtx` package is missing, when
KVTRACE_NVTX=0, or when no profiler listens (NVTX then hands out a disabled domain). On, a call costs a
few µs: step messages are unique, so each is registered with the profiler as it is used (registered
strings are what nsys stores in `StringIds`); phase and layer messages are registered once.
Ranges are per thread (NVTX push/pop): push and pop on the thread that runs the step.
"""

from __future__ import annotations

import os
import time
from typing import Any

DOMAIN = "kvtrace"
PHASES = ("schedule", "execute", "update")
# ARGB colours, so that nvtx never needs matplotlib to resolve a colour name.
STEP_COLOR, MARK_COLOR, LAYER_COLOR = 0xFF76B900, 0xFFFFFFFF, 0xFF8C8C8C
PHASE_COLORS = {"schedule": 0xFF1F77B4, "execute": 0xFFD62728, "update": 0xFF9467BD}

_domain: Any = None  # the NVTX domain while on; None while off
_layers = False  # per-layer ranges wanted (and on)
_fixed: dict[Any, Any] = {}  # event attributes of the fixed messages (phases, layers), made once
_register: Any = None  # nvtx's RegisteredString: registers a string without caching it forever


def configure(enabled: bool | None = None, layers: bool | None = None, domain: Any = None) -> bool:
    """Turn the ranges on or off; returns whether they are emitted.

    `enabled` defaults to KVTRACE_NVTX (on unless "0"), `layers` to KVTRACE_NVTX_LAYERS (off unless
    "1"). On needs the `nvtx` package and a profiler listening; `domain` stands in for nvtx's domain
    object (tests pass a recording one). Runs at import; call it again after changing the environment.
    """
    global _domain, _layers, _register
    if enabled is None:
        enabled = os.environ.get("KVTRACE_NVTX", "1") != "0"
    if layers is None:
        layers = os.environ.get("KVTRACE_NVTX_LAYERS", "0") == "1"
    _domain, _layers = None, False
    _fixed.clear()
    if not enabled:
        return False
    try:
        import nvtx
        from nvtx._lib import RegisteredString
    except ImportError:
        return False
    if domain is None:
        domain = nvtx.get_domain(DOMAIN)
        if getattr(domain, "handle", None) is None:  # nvtx's DummyDomain: no profiler listening
            return False
    _register = RegisteredString
    _domain, _layers = domain, layers
    return True


def enabled() -> bool:
    return _domain is not None


def mark_message(step: int, mono_ns: int) -> str:
    """The text of a step's alignment mark (ingest parses it with nsys_align.MARK_PATTERN)."""
    return f"kvtrace:step={step}:mono_ns={mono_ns}"


def _attributes(message: str, color: int) -> Any:
    attrs = _domain.get_event_attributes(color=color)
    attrs.message = _register(_domain.handle, message)
    return attrs


def _fixed_attributes(key: Any, message: str, color: int) -> Any:
    attrs = _fixed.get(key)
    if attrs is None:
        attrs = _fixed[key] = _domain.get_event_attributes(message=message, color=color)
    return attrs


def push_step(step: int) -> None:
    """Mark the step with our clock, then open its range `kvtrace step <step>` (close it with `pop`)."""
    if _domain is None:
        return
    message = mark_message(step, time.monotonic_ns())
    _domain.mark(_attributes(message, MARK_COLOR))
    _domain.push_range(_attributes(f"kvtrace step {step}", STEP_COLOR))


def push_phase(name: str) -> None:
    """Open the range `kvtrace <name>` (schedule, execute or update; close it with `pop`)."""
    if _domain is None:
        return
    _domain.push_range(_fixed_attributes(name, f"kvtrace {name}", PHASE_COLORS.get(name, STEP_COLOR)))


def pop() -> None:
    """Close the innermost open step or phase range of this thread."""
    if _domain is None:
        return
    _domain.pop_range()


class _Pop:
    """A context whose exit closes the range its creator opened."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        pop()
        return False


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_POP, _NOTHING = _Pop(), _Nothing()


def step(step_id: int) -> _Pop | _Nothing:
    """`with step(1234):` the step's mark and range."""
    if _domain is None:
        return _NOTHING
    push_step(step_id)
    return _POP


def phase(name: str) -> _Pop | _Nothing:
    """`with phase("execute"):` a phase range of the current step."""
    if _domain is None:
        return _NOTHING
    push_phase(name)
    return _POP


def layer(index: int) -> _Pop | _Nothing:
    """`with layer(7):` the range `kvtrace layer 7`, when per-layer ranges are on."""
    if not _layers:
        return _NOTHING
    _domain.push_range(_fixed_attributes(index, f"kvtrace layer {index}", LAYER_COLOR))
    return _POP


configure()
