"""What every probe is: named hooks checked before patching, undoable patches, and fault isolation.

A probe must never take vLLM down. Before it patches anything it resolves every target it needs and
checks the parameters it relies on. Its hooks (`hooks()`) say what it patches; a hook may have several
variants (the same thing in different vLLM releases or runners: the first variant whose targets all
exist is used), and may be optional (without it the probe still runs, and records less: it is
`degraded`, and says what is lost). A required hook with no variant present disables the probe. Either
way the reason is in the process's `proc.json`, then in the manifest, `ingest` and `summary`, and the
run goes on. An exception raised by probe code inside a wrapper disables that probe for the rest of the
run, is counted and recorded, and never reaches vLLM: wrappers always call the original.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtrace.record.recorder import Recorder


class TargetMissing(Exception):
    """A patch target is absent or its signature changed: the probe is disabled, the engine is not."""


def resolve(module: str, qualname: str) -> Any:
    """Import `module` and walk `qualname` (`Class.method`); TargetMissing when any part is absent."""
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:  # an optional dependency missing inside vLLM counts as "absent"
        raise TargetMissing(f"cannot import {module}: {exc.__class__.__name__}: {exc}") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise TargetMissing(f"{module}.{qualname} not found (no attribute {part!r})")
        obj = getattr(obj, part)
    return obj


def check_params(func: Callable, params: tuple[str, ...], where: str) -> None:
    """The parameters a wrapper reads by name must still exist under those names."""
    if not params:
        return
    try:
        names = set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        raise TargetMissing(f"{where}: signature cannot be inspected") from None
    missing = [p for p in params if p not in names]
    if missing:
        raise TargetMissing(f"{where}: signature changed, missing parameter(s) {', '.join(missing)}")


Target = tuple[str, str, tuple[str, ...]]  # (module, qualname, parameter names the wrapper reads)


class Hook(NamedTuple):
    """One thing a probe patches. `variants`: alternatives, each a tuple of targets that must all exist;
    the first whose targets all exist is used (`Probe.variant(name)` says which). Without any, a
    required hook disables the probe, an optional one only loses `lost` (the probe is `degraded`)."""

    name: str
    variants: tuple[tuple[Target, ...], ...]
    required: bool = True
    lost: str = ""


def pick_variant(hook: Hook, check_targets: Callable[[Any], None] | None = None) -> tuple[int | None, list[str]]:
    """(index of the first variant of `hook` whose targets all exist here, or None; why each variant
    before it, or every variant, is missing). `check_targets` raises TargetMissing for targets that are
    not there (default: `Probe.check_targets`, on the imported vLLM)."""
    check = check_targets or Probe.check_targets
    why = []
    for i, targets in enumerate(hook.variants):
        try:
            check(targets)
        except TargetMissing as exc:
            why.append(str(exc))
            continue
        return i, why
    return None, why


class Probe:
    """A named group of patches that is enabled, disabled or failed as one.

    Subclasses list what they patch in `hooks()` (or, for hooks of one variant, their targets as
    (module, qualname, required parameter names) in `targets()`) and patch them in `install_patches()`
    with `self.patch(...)`, reading `self.variant(name)` for hooks that differ between vLLM versions.
    """

    name = "probe"
    # Hook name -> the variant this process's vLLM has (None: missing), and what the optional hooks it
    # lacks leave unrecorded; set on the class by `resolve_hooks` (the same for every instance in a
    # process). Not instance attributes: CPython 3.11 keeps at most 29 of those inline, and the scheduler
    # probe's wrappers read its own on every call.
    variants: dict[str, int | None] = {}
    lost: list[str] = []

    def __init__(self, recorder: Recorder, options: dict[str, Any]):
        self.rec = recorder
        self.options = options
        self.enabled = False
        self.faults = 0
        self._patches: list[tuple[Any, str, Any]] = []

    @classmethod
    def targets(cls) -> list[Target]:
        """Targets that must all exist (each a required hook of one variant). Class methods, as `hooks`:
        declarations, read without making a probe (`kvtrace doctor`)."""
        return []

    @classmethod
    def hooks(cls) -> list[Hook]:
        """Everything the probe patches: `targets()` as required hooks, plus a subclass's own."""
        return [Hook(qualname, (((module, qualname, tuple(params)),),)) for module, qualname, params in cls.targets()]

    def variant(self, hook: str) -> int | None:
        """Which variant of `hook` this vLLM has (index into its variants), or None when it has none."""
        return self.variants.get(hook)

    def install_patches(self) -> None:
        raise NotImplementedError

    # A module this probe's targets live in that only some vLLM processes load, and that is costly to
    # import: the probe installs when it is imported (probes/imports.py), not by importing it itself.
    defer_until: str | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def install(self) -> bool:
        """Check every target, then patch; or, with `defer_until` not yet imported, arrange that and
        return True. Returns False (and records why) when the probe is off."""
        if self.defer_until and self.defer_until not in sys.modules:
            from kvtrace.probes.imports import when_imported

            if when_imported(self.defer_until, lambda _module: self.install_now()):
                # Stays "unused" in a process that never loads it (a front end); "attached" once it does.
                self.rec.set_probe_status(self.name, "unused", f"{self.defer_until} not imported in this process")
                return True
        return self.install_now()

    def install_now(self) -> bool:
        """Check every hook, then patch. Returns False (and records why) when the probe is off."""
        extra = self.options.get("extra_targets", {}).get(self.name, [])  # used by drift tests
        try:
            self.check_targets(extra)
            self.resolve_hooks()
            self.install_patches()
        except Exception as exc:
            self.give_up(exc)
            return False
        self.enabled = True
        self.mark_attached()
        return True

    def resolve_hooks(self) -> None:
        """Pick each hook's variant (`self.variants`); TargetMissing for a required hook with none, and
        what is lost (`self.lost`) for an optional one."""
        variants: dict[str, int | None] = {}
        lost: list[str] = []
        cls = type(self)
        cls.variants, cls.lost = variants, lost
        for hook in self.hooks():
            variants[hook.name], why = pick_variant(hook)
            if variants[hook.name] is None:
                if hook.required:
                    raise TargetMissing("; ".join(why))
                lost.append(f"{hook.lost} ({' / '.join(why)})")

    def mark_attached(self) -> None:
        """Status "attached", or "degraded" with what is lost when an optional hook is missing."""
        if self.lost:
            reason = "; ".join(f"not recorded: {what}" for what in self.lost)
            self.rec.set_probe_status(self.name, "degraded", reason)
            self.rec.warn(f"probe {self.name} degraded: {reason}")
        else:
            self.rec.set_probe_status(self.name, "attached")

    @staticmethod
    def check_targets(targets: Any) -> None:
        """TargetMissing unless every (module, qualname, parameter names) target exists as named."""
        for module, qualname, params in targets:
            check_params(resolve(module, qualname), tuple(params), f"{module}.{qualname}")

    def give_up(self, exc: BaseException) -> None:
        """Installing failed: restore what was patched and record why (a missing or changed target
        disables the probe; any other error while patching is a failure)."""
        self.uninstall()
        if isinstance(exc, TargetMissing):
            self.rec.set_probe_status(self.name, "disabled", str(exc))
            self.rec.warn(f"probe {self.name} disabled: {exc}")
        else:
            self.rec.set_probe_status(self.name, "failed", f"patching failed: {exc!r}")
            self.rec.warn(f"probe {self.name} failed to install: {exc!r}")

    def patch(self, owner: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> Any:
        """Replace owner.attr by make_wrapper(original); remembered so `uninstall` restores it."""
        original = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
        wrapper = make_wrapper(original)
        try:
            wrapper.__wrapped__ = original
            wrapper.__kvtrace_probe__ = self.name
        except AttributeError:
            pass
        setattr(owner, attr, wrapper)
        self._patches.append((owner, attr, original))
        return original

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._patches):
            setattr(owner, attr, original)
        self._patches.clear()
        self.enabled = False

    def fail(self, exc: BaseException) -> None:
        """Called from a wrapper's except clause: switch this probe off for the rest of the run."""
        self.faults += 1
        if not self.enabled:
            return
        self.enabled = False
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
        self.rec.set_probe_status(self.name, "failed", f"{exc.__class__.__name__}: {exc}{at}")
        self.rec.info.setdefault("probe_faults", {})[self.name] = self.faults
        self.rec.warn(f"probe {self.name} raised {exc!r}{at}; disabled for the rest of the run")

    def maybe_inject_fault(self) -> None:
        """Test hook: KVTRACE_OPTIONS {"inject_fault": "<probe name>"} makes this probe raise once."""
        if self.options.get("inject_fault") == self.name:
            raise RuntimeError(f"injected fault in probe {self.name}")


# ---- wrappers that keep vLLM's calls fast -----------------------------------------------------------
# Each wrapper's file name (`<kvtrace wrapper of QUALNAME>`) -> the lines that call the original. A sampling
# profiler puts there the time the original's frame takes to be torn down (its locals freed) after it
# returns: vLLM's time, not the wrapper's (bench/profile_engine_thread.py tells them apart).
WRAPPER_CALL_LINES: dict[str, list[int]] = {}


def exact_wrapper(orig: Any, body: str, env: dict) -> Any:
    """A wrapper of `orig` with orig's own parameter list instead of `*args, **kwargs`.

    CPython (3.11+) specialises calls of plain Python functions with fixed parameters: vLLM's call into
    the wrapper and the wrapper's call of the original stay "inlined" Python calls. A `*args, **kwargs`
    wrapper makes both generic (argument tuple and dict, C-level recursion): measured with callgrind,
    ~7,000 instructions per call against ~1,000, for block-pool methods called thousands of times a
    second. `body` is the wrapper's code (it may name orig's parameters, which `targets()` checks);
    `{call}` in it becomes the call of the original forwarding every parameter as declared (keyword-only
    ones by name, `*args` / `**kwargs` when orig has them), `{self}` the first parameter's name.
    """
    import inspect

    sig = inspect.signature(orig)
    params: list[str] = []
    call: list[str] = []
    ns = dict(env)
    ns["__orig"] = orig
    star = False
    for i, p in enumerate(sig.parameters.values()):
        text = p.name
        if p.default is not inspect.Parameter.empty:
            ns[f"__d{i}"] = p.default
            text += f"=__d{i}"
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(text)
            call.append(f"{p.name}={p.name}")
        else:
            params.append(text)
            call.append(p.name)
    first = next(iter(sig.parameters), "self")
    src = f"def wrapper({', '.join(params)}):" + body.replace("{call}", f"__orig({', '.join(call)})").replace(
        "{self}", first)
    filename = f"<kvtrace wrapper of {getattr(orig, '__qualname__', orig)}>"
    WRAPPER_CALL_LINES[filename] = [i for i, line in enumerate(src.splitlines(), 1) if "__orig(" in line]
    exec(compile(src, filename, "exec"), ns)
    wrapper = ns["wrapper"]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__qualname__ = getattr(orig, "__qualname__", wrapper.__name__)
    return wrapper


def patch_exact(probe: Probe, owner: Any, bodies: dict[str, str], env: dict) -> None:
    """Patch each `owner.NAME` for `probe` with `exact_wrapper(original, bodies[NAME], env)`."""
    for name, body in bodies.items():
        probe.patch(owner, name, lambda orig, body=body: exact_wrapper(orig, body, env))


def before_call(handler: str, condition: str = "") -> str:
    """The `exact_wrapper` body of a wrapper that runs the handler call `handler` (while the probe is on
    and `condition` holds), then calls the original; the handler's errors switch the probe off."""
    return f"""
    if probe.enabled{condition}:
        try:
            {handler}
        except Exception as exc:
            probe.fail(exc)
    return {{call}}"""


def after_call(handler: str, condition: str = "") -> str:
    """The `exact_wrapper` body of a wrapper that calls the original, then (while the probe is on and
    `condition` holds) the handler call `handler`, whose errors switch the probe off, never vLLM."""
    return f"""
    result = {{call}}
    if probe.enabled{condition}:
        try:
            {handler}
        except Exception as exc:
            probe.fail(exc)
    return result"""


def _len_of_field(self):  # the shape of vLLM's Request.num_tokens: `return len(self.<field>)`
    return len(self.field)


def _field_of_field(self):  # the shape of vLLM's BlockPool.get_num_free_blocks: `return self.<a>.<b>`
    return self.a.b


def returns_field_of_field(func: Any, first: str, second: str) -> bool:
    """Whether `func(self)` does nothing but `return self.<first>.<second>`, as vLLM's
    `BlockPool.get_num_free_blocks` (`free_block_queue.num_free_blocks`) does. The probes then read the
    attributes (operator.attrgetter, in C) instead of making a Python call per step."""
    code = getattr(func, "__code__", None)
    return (code is not None and code.co_code == _field_of_field.__code__.co_code
            and code.co_names == (first, second) and code.co_argcount == 1)


def is_len_of(cls: Any, prop: str, field: str) -> bool:
    """Whether `cls.prop` is a property that returns `len(self.field)` and nothing else, as vLLM's
    `Request.num_tokens` (`_all_token_ids`) and `num_output_tokens` (`_output_token_ids`) are. The
    probes then read `len(request.field)`: CPython 3.11 does not specialise property reads, so each is
    a generic lookup and a Python call made from C (~700 instructions, a few thousand a round in
    bench/bench_host_probes.py), where the field's read is specialised."""
    code = getattr(getattr(getattr(cls, prop, None), "fget", None), "__code__", None)
    return (code is not None and code.co_code == _len_of_field.__code__.co_code
            and code.co_names == ("len", field) and code.co_argcount == 1)


def request_lengths_are_fields() -> bool:
    """Whether vLLM's `Request.num_tokens` and `num_output_tokens` are `len()` of `_all_token_ids` and
    `_output_token_ids` (`is_len_of`); False where vLLM's Request is not importable or differs."""
    try:
        from vllm.v1.request import Request
    except Exception:
        return False
    return is_len_of(Request, "num_tokens", "_all_token_ids") and is_len_of(
        Request, "num_output_tokens", "_output_token_ids")
