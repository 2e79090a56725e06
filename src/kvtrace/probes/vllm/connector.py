"""KV connector probe (EngineCore and Worker): one `transfers` row per connector call, for any connector.

vLLM builds every KV connector through `KVConnectorFactory.create_connector` (vLLM 0.32: once in the
EngineCore with the SCHEDULER role, from `Scheduler.__init__`; once per worker with the WORKER role, from
`ensure_kv_transfer_initialized`). The probe wraps that factory and then the methods of the instance it
returns (instance attributes shadow the class's), so it needs to know nothing about the connector class.

Scheduler side (EngineCore; `step` = ctx.step, the step being scheduled or finished):
  get_num_new_matched_tokens -> match (tokens = matched), update_state_after_alloc -> alloc (tokens =
  external tokens vLLM admitted), build_connector_meta -> other, request_finished[_all_groups] -> finish
  (tokens = 1 when the connector delays the free). The admitted external tokens also go to the prefix
  probe (`PrefixCacheProbe.external_matches`) so `prefix_lookups.external_hit_tokens` is filled.
Worker side (`step` = the `_kvtrace_step` tag of the SchedulerOutput being executed):
  start_load_kv and wait_for_layer_load -> load, save_kv_layer and wait_for_save -> save, get_finished
  (or an overridden get_transfer_results) -> one row per request reported done (save = send finished,
  load = receive finished), or one `other` row when none was.

Deferred loads (vLLM 0.33, with overlapping batches, a KV consumer and HiSparse): vLLM admits an async load
but tells the connector (`update_state_after_alloc`) only once the steps in flight have finished, from a
later `update_from_output`, keeping the admitted external tokens in `Scheduler.deferred_loads` meanwhile.
The alloc row is written when the connector is told (that later step); the lookup, which vLLM counts at
admission, gets the admitted external tokens then, read from `deferred_loads` as vLLM fills it.

Bytes: a connector whose bound metadata lists requests with slot mappings (`meta.requests[i].slot_mapping`
and `.is_store`, as ExampleConnector's does) gets one row per (request, layer) with bytes = slots x the
layer's KV bytes per token; any other connector gets one row per call, save_kv_layer's bytes being the
layer's KV bytes for the slots written this step (attn_metadata.num_actual_tokens) and null where the
probe cannot know. See docs/connectors.md.
"""

from __future__ import annotations

import time
from typing import Any

from kvtrace.probes.base import Hook, Probe
from kvtrace.record.context import ctx

_now = time.monotonic_ns
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
WORKER = "vllm.v1.worker.worker_base"
SCHED = "vllm.v1.core.sched.scheduler"

# Scheduler-side methods that write no row but may hold or let go of blocks (offload connectors keep
# blocks referenced while they are stored or loaded): wrapped only so their pool calls count as holds.
HOLD_ONLY_METHODS = ("update_connector_output", "register_finished_partial_tail", "reset_cache", "on_new_request")
SCHEDULER_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "request_finished", "request_finished_all_groups", "bind_kv_cache_manager", *HOLD_ONLY_METHODS)
WORKER_METHODS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                  "wait_for_save", "get_finished", "get_transfer_results")


class _Conn:
    """What the probe knows about one connector instance."""

    __slots__ = ("name", "block_size", "num_blocks", "token_bytes", "layers", "kvm", "plan", "flat", "lookups",
                 "in_finish")

    def __init__(self, conn: Any, config: Any, kv_cache_config: Any):
        self.name = type(conn).__name__
        self.block_size = int(getattr(getattr(config, "cache_config", None), "block_size", 0) or 0)
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.token_bytes = layer_token_bytes(kv_cache_config)  # layer -> KV bytes per token
        self.layers = list(self.token_bytes)
        self.kvm = None  # the scheduler's KVCacheManager, once bind_kv_cache_manager is called
        self.plan: list[tuple] | None = None  # bound metadata: [(request_id, is_store, slots)] or None
        # Bound metadata that lists whole blocks to copy (SimpleCPUOffloadConnector's), until the call
        # that launches the copies: [(direction, request_id or None, blocks)]
        self.flat: list[tuple] | None = None
        self.lookups: dict[str, int] = {}  # request -> ts of its connector lookup, until admitted
        self.in_finish = False


class DeferredLoads(dict):
    """vLLM 0.33's `Scheduler.deferred_loads` (request -> (fence step, external tokens, queries, hits)) that
    calls `on_deferred(request_id, entry)` as vLLM defers a load; otherwise the dict vLLM made."""

    __slots__ = ("on_deferred",)

    def __init__(self, items: dict, on_deferred: Any):
        super().__init__(items)
        self.on_deferred = on_deferred

    def __setitem__(self, request_id: str, entry: tuple) -> None:
        super().__setitem__(request_id, entry)
        self.on_deferred(request_id, entry)


def layer_token_bytes(kv_cache_config: Any) -> dict[str, int]:
    """KV bytes per token of each attention layer, from the KV cache spec (layout-independent)."""
    out: dict[str, int] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        try:
            per_token = int(spec.page_size_bytes) // int(spec.block_size)
        except Exception:  # a spec without a page size (not an attention layer)
            continue
        for layer in group.layer_names:
            out[layer] = per_token
    return out


def in_connector(method: Any, args: tuple, kwargs: dict) -> Any:
    """Call a connector's method with `ctx.connector` naming the connector: the block-pool calls it makes
    meanwhile are its holds (kv_blocks: touch -> hold, free -> release), not the scheduler's."""
    before = ctx.connector
    ctx.connector = type(getattr(method, "__self__", method)).__name__
    try:
        return method(*args, **kwargs)
    finally:
        ctx.connector = before


class ConnectorProbe(Probe):
    name = "connector"

    # vLLM 0.33's deferred async loads (see the module's docstring): the Scheduler built, then its
    # `deferred_loads` watched. Releases without `_drain_deferred_loads` tell the connector at admission.
    DEFERRED_LOADS = Hook("deferred loads", (
        ((SCHED, "Scheduler.__init__", ()), (SCHED, "Scheduler._drain_deferred_loads", ())),
        (),
    ), required=False)

    @classmethod
    def hooks(cls):
        return [*super().hooks(), cls.DEFERRED_LOADS]

    @classmethod
    def targets(cls):
        return [
            (FACTORY, "KVConnectorFactory.create_connector", ("config", "role", "kv_cache_config")),
            (BASE, "KVConnectorBase_V1.get_num_new_matched_tokens", ("request", "num_computed_tokens")),
            (BASE, "KVConnectorBase_V1.update_state_after_alloc",
             ("request", "blocks", "num_external_tokens")),
            (BASE, "KVConnectorBase_V1.build_connector_meta", ("scheduler_output",)),
            (BASE, "KVConnectorBase_V1.request_finished", ("request", "block_ids")),
            (BASE, "KVConnectorBase_V1.bind_connector_metadata", ("connector_metadata",)),
            (BASE, "KVConnectorBase_V1.start_load_kv", ("forward_context",)),
            (BASE, "KVConnectorBase_V1.wait_for_layer_load", ("layer_name",)),
            (BASE, "KVConnectorBase_V1.save_kv_layer", ("layer_name", "kv_layer", "attn_metadata")),
            (BASE, "KVConnectorBase_V1.wait_for_save", ()),
            (BASE, "KVConnectorBase_V1.get_finished", ("finished_req_ids",)),
            (WORKER, "WorkerWrapperBase.execute_model", ("scheduler_output",)),
        ]

    def install_patches(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        self.out = self.rec.buffer("transfers")
        self.lookups_out = self.rec.buffer("prefix_lookups")
        self.instances: list[tuple[Any, list[str]]] = []  # (connector, wrapped attribute names)
        self.worker_step = -1  # step of the SchedulerOutput the worker is executing
        self.sched_out: Any = None
        self._prefix_probe: Any = None
        probe = self

        def create_connector(orig):
            func = orig.__func__  # a classmethod: keep it one
            def wrapper(cls, config, role, kv_cache_config, *args, **kwargs):
                conn = func(cls, config, role, kv_cache_config, *args, **kwargs)
                if probe.enabled:
                    try:
                        probe.attach(conn, config, role, kv_cache_config)
                    except Exception as exc:
                        probe.fail(exc)
                return conn
            wrapper.__wrapped__ = func
            wrapper.__kvtrace_probe__ = probe.name  # a classmethod's own __wrapped__ is read-only
            return classmethod(wrapper)

        def execute_model(orig):
            def wrapper(worker, scheduler_output, *args, **kwargs):
                probe.worker_step = getattr(scheduler_output, "_kvtrace_step", -1)
                probe.sched_out = scheduler_output
                return orig(worker, scheduler_output, *args, **kwargs)
            return wrapper

        self.patch(KVConnectorFactory, "create_connector", create_connector)
        self.patch(WorkerWrapperBase, "execute_model", execute_model)
        self.sched_side: tuple[Any, _Conn] | None = None  # the last scheduler-side connector attached
        if self.variant("deferred loads") == 0:
            from vllm.v1.core.sched.scheduler import Scheduler

            def scheduler_init(orig):
                def wrapper(sched, *args, **kwargs):
                    orig(sched, *args, **kwargs)
                    if probe.enabled and getattr(sched, "defer_async_loads", False):
                        try:
                            probe.watch_deferred_loads(sched)
                        except Exception as exc:
                            probe.fail(exc)
                return wrapper

            self.patch(Scheduler, "__init__", scheduler_init)

    def uninstall(self) -> None:
        for conn, attrs in getattr(self, "instances", ()):
            for attr in attrs:
                conn.__dict__.pop(attr, None)  # the class's method shows through again
        super().uninstall()

    # ---- instance wrapping -----------------------------------------------------------------------
    def attach(self, conn: Any, config: Any, role: Any, kv_cache_config: Any) -> None:
        state = _Conn(conn, config, kv_cache_config)
        side = getattr(role, "name", str(role)).upper()
        names = SCHEDULER_METHODS if side == "SCHEDULER" else WORKER_METHODS
        cls = type(conn)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        # get_transfer_results calls get_finished unless a connector overrides it: wrap one, never both.
        results = getattr(cls, "get_transfer_results", None)
        own_results = results is not None and results is not getattr(
            KVConnectorBase_V1, "get_transfer_results", None)
        wrapped = []
        for name in names:
            if name == ("get_finished" if own_results else "get_transfer_results"):
                continue
            method = getattr(conn, name, None)
            if method is None or not callable(method):
                continue
            make = self._w_holds_only if name in HOLD_ONLY_METHODS else getattr(self, "_w_" + name)
            try:
                setattr(conn, name, make(method, state))
            except (AttributeError, TypeError):  # __slots__ or a read-only attribute: not observed
                continue
            wrapped.append(name)
        self.instances.append((conn, wrapped))
        self.rec.info.setdefault("connectors", []).append(
            {"class": state.name, "role": side.lower(), "wrapped": wrapped})
        if side == "SCHEDULER":  # an offload tier's own BlockPool: its block events go apart, by this name
            self.sched_side = (conn, state)
            from kvtrace.probes.vllm.kv_blocks import name_pools

            name_pools(conn, state.name)

    def _row(self, t0: int, t1: int, step: int, state: _Conn, method: str, direction: str,
             request_id: str | None = None, layer: str | None = None, nbytes: int | None = None,
             tokens: int | None = None) -> None:
        self.out.append((t0, t1, step, state.name, method, direction, request_id, layer, nbytes, tokens))

    def _call(self, method: Any, record: Any, args: tuple, kwargs: dict) -> Any:
        """Run the connector's method; then `record(t0, t1, result)`, which may never reach vLLM."""
        if not self.enabled:
            return method(*args, **kwargs)
        t0 = _now()
        result = in_connector(method, args, kwargs)
        t1 = _now()
        try:
            self.maybe_inject_fault()
            record(t0, t1, result)
        except Exception as exc:
            self.fail(exc)
        return result

    def prefix_probe(self) -> Any:
        """The PrefixCacheProbe of this process (for external_matches), or None."""
        if self._prefix_probe is None:
            from kvtrace.probes import lifecycle

            for p in lifecycle._installed:
                if getattr(p, "name", None) == "prefix_cache":
                    self._prefix_probe = p
        p = self._prefix_probe
        return p if p is not None and p.enabled else None

    # ---- scheduler side (EngineCore) ---------------------------------------------------------------
    def _w_bind_kv_cache_manager(self, method, state):
        def wrapper(kv_cache_manager, *args, **kwargs):
            state.kvm = kv_cache_manager
            return method(kv_cache_manager, *args, **kwargs)
        return wrapper

    def _w_holds_only(self, method, state):
        def wrapper(*args, **kwargs):
            if not self.enabled:
                return method(*args, **kwargs)
            return in_connector(method, args, kwargs)
        return wrapper

    def _w_get_num_new_matched_tokens(self, method, state):
        def wrapper(*args, **kwargs):
            request = _arg(args, kwargs, 0, "request")

            def record(t0, t1, result):
                matched = result[0] if isinstance(result, tuple) else result
                rid = request.request_id
                self._row(t0, t1, ctx.step, state, "get_num_new_matched_tokens", "match", rid,
                          tokens=matched)
                if matched is not None:
                    state.lookups[rid] = t0
                    prefix = self.prefix_probe()
                    if prefix is not None:
                        prefix.external_matches[rid] = matched  # refined at update_state_after_alloc
            return self._call(method, record, args, kwargs)
        return wrapper

    def _w_update_state_after_alloc(self, method, state):
        def wrapper(*args, **kwargs):
            request = _arg(args, kwargs, 0, "request")
            num_external = _arg(args, kwargs, 2, "num_external_tokens")

            def record(t0, t1, _result):
                rid = request.request_id
                self._row(t0, t1, ctx.step, state, "update_state_after_alloc", "alloc", rid,
                          tokens=num_external)
                self.on_admitted(state, request, num_external)
            return self._call(method, record, args, kwargs)
        return wrapper

    def on_admitted(self, state: _Conn, request: Any, num_external: int) -> None:
        """vLLM admitted a request with `num_external` tokens from the connector (it counts the lookup
        right after telling the connector, or at once when it defers telling it).

        After a connector lookup this admission (none, e.g., for a request whose remote KV arrived), the
        external tokens it admitted (the raw match trimmed to blocks and past the local hit) go to the
        prefix probe. When the local prefix cache is off for the request, the prefix probe writes no
        lookup row, so this probe writes it: hit_tokens 0, missed_hashes null (no local lookup).
        """
        rid = request.request_id
        looked_at = state.lookups.pop(rid, None)
        if looked_at is None:
            return
        prefix = self.prefix_probe()
        if prefix is None:
            return
        prefix.external_matches[rid] = num_external
        kvm = state.kvm
        if kvm is None or kvm.prefix_cache_lookup_enabled(request):
            return  # the prefix probe records the lookup, with external_hit_tokens
        if getattr(prefix, "records_connector_only_lookups", False):
            return  # a prefix probe that writes these rows itself
        prefix.external_matches.pop(rid, None)
        hash_block = getattr(kvm.block_pool, "hash_block_size", 0) or state.block_size or 1
        full = len(request.block_hashes)
        query = request.num_tokens
        self.lookups_out.append((looked_at, ctx.step, rid, query, 0, 0, full, query - full * hash_block,
                                 None, num_external, 1 if request.num_preemptions > 0 else 0))

    def watch_deferred_loads(self, sched: Any) -> None:
        """A Scheduler that defers async loads was just built (with its connector, attached above): its
        `deferred_loads` becomes a dict that reports each deferral, so the lookup vLLM counts at that
        admission gets the external tokens it admitted (`update_state_after_alloc` comes steps later)."""
        if self.sched_side is None or self.sched_side[0] is not sched.connector:
            return  # a connector this probe did not wrap
        state = self.sched_side[1]
        probe = self

        def on_deferred(request_id: str, entry: tuple) -> None:
            if not probe.enabled:
                return
            try:  # entry: (fence step, external tokens, queries, hits)
                probe.on_admitted(state, sched.requests[request_id], int(entry[1]))
            except Exception as exc:
                probe.fail(exc)

        sched.deferred_loads = DeferredLoads(sched.deferred_loads, on_deferred)

    def _w_build_connector_meta(self, method, state):
        def wrapper(*args, **kwargs):
            def record(t0, t1, _meta):
                self._row(t0, t1, ctx.step, state, "build_connector_meta", "other")
            return self._call(method, record, args, kwargs)
        return wrapper

    def _finish_wrapper(self, method, state, name):
        def wrapper(*args, **kwargs):
            if state.in_finish:  # request_finished_all_groups calling request_finished: one row
                return method(*args, **kwargs)
            request = _arg(args, kwargs, 0, "request")

            def record(t0, t1, result):
                delay = bool(result[0]) if isinstance(result, tuple) and result else False
                self._row(t0, t1, ctx.step, state, name, "finish", request.request_id, tokens=int(delay))
            state.in_finish = True
            try:
                return self._call(method, record, args, kwargs)
            finally:
                state.in_finish = False
        return wrapper

    def _w_request_finished(self, method, state):
        return self._finish_wrapper(method, state, "request_finished")

    def _w_request_finished_all_groups(self, method, state):
        return self._finish_wrapper(method, state, "request_finished_all_groups")

    # ---- worker side ---------------------------------------------------------------------------
    def _w_bind_connector_metadata(self, method, state):
        def wrapper(*args, **kwargs):
            if self.enabled:
                try:
                    meta = _arg(args, kwargs, 0, "connector_metadata")
                    flat = block_lists(meta)
                    # A block-list connector's copies start in get_finished, never in save_kv_layer /
                    # start_load_kv: those calls move nothing (an empty plan), not "what the layer wrote".
                    state.plan = [] if flat is not None else self.request_plan(state, meta)
                    if flat:  # kept until get_finished launches them (a step may bind twice)
                        state.flat = (state.flat or []) + flat
                except Exception as exc:
                    state.plan = None
                    self.fail(exc)
            return method(*args, **kwargs)
        return wrapper

    def request_plan(self, state: _Conn, meta: Any) -> list[tuple] | None:
        """[(request_id, is_store, slots)] when the metadata lists requests with slot mappings, else None.

        ExampleConnector's entries carry no request id: it is found from the block of the first slot,
        among the blocks the SchedulerOutput being executed gives its requests.
        """
        reqs = getattr(meta, "requests", None)
        if not isinstance(reqs, (list, tuple)) or any(
                not hasattr(r, "slot_mapping") or not hasattr(r, "is_store") for r in reqs):
            return None
        owner: dict[int, str] = {}
        so = self.sched_out
        if reqs and so is not None and state.block_size:
            for new in so.scheduled_new_reqs:
                for b in (new.block_ids[0] if new.block_ids else ()):
                    owner[b] = new.req_id
            cached = so.scheduled_cached_reqs
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
                for b in (ids[0] if ids else ()):
                    owner[b] = rid
        plan = []
        for r in reqs:
            slots = int(len(r.slot_mapping))
            rid = owner.get(int(r.slot_mapping[0]) // state.block_size) if slots and state.block_size else None
            plan.append((rid, bool(r.is_store), slots))
        return plan

    def _w_start_load_kv(self, method, state):
        def wrapper(*args, **kwargs):
            def record(t0, t1, _result):
                step, plan = self.worker_step, state.plan
                if plan is None:
                    self._row(t0, t1, step, state, "start_load_kv", "load")
                    return
                loads = [(rid, slots) for rid, is_store, slots in plan if not is_store]
                for rid, slots in loads:  # the connector loads every layer of each request in this call
                    for layer in state.layers:
                        self._row(t0, t1, step, state, "start_load_kv", "load", rid, layer,
                                  slots * state.token_bytes[layer], slots)
                if not loads:
                    self._row(t0, t1, step, state, "start_load_kv", "load", nbytes=0, tokens=0)
            return self._call(method, record, args, kwargs)
        return wrapper

    def _w_wait_for_layer_load(self, method, state):
        def wrapper(*args, **kwargs):
            layer = _arg(args, kwargs, 0, "layer_name")

            def record(t0, t1, _result):
                self._row(t0, t1, self.worker_step, state, "wait_for_layer_load", "load", layer=layer)
            return self._call(method, record, args, kwargs)
        return wrapper

    def _w_save_kv_layer(self, method, state):
        def wrapper(*args, **kwargs):
            layer = _arg(args, kwargs, 0, "layer_name")

            def record(t0, t1, _result):
                step, plan = self.worker_step, state.plan
                per_token = state.token_bytes.get(layer)
                if per_token is None:
                    per_token = tensor_token_bytes(_arg(args, kwargs, 1, "kv_layer"), state)
                if plan is None:  # unknown metadata: what the layer wrote this step
                    slots = _written_slots(_arg(args, kwargs, 2, "attn_metadata"))
                    self._row(t0, t1, step, state, "save_kv_layer", "save", None, layer,
                              None if slots is None or per_token is None else slots * per_token, slots)
                    return
                saved = 0
                for rid, is_store, slots in plan:
                    if is_store:
                        saved += 1
                        self._row(t0, t1, step, state, "save_kv_layer", "save", rid, layer,
                                  None if per_token is None else slots * per_token, slots)
                if not saved:
                    self._row(t0, t1, step, state, "save_kv_layer", "save", None, layer, 0, 0)
            return self._call(method, record, args, kwargs)
        return wrapper

    def _w_wait_for_save(self, method, state):
        def wrapper(*args, **kwargs):
            def record(t0, t1, _result):
                self._row(t0, t1, self.worker_step, state, "wait_for_save", "save")
            return self._call(method, record, args, kwargs)
        return wrapper

    def _done_rows(self, t0, t1, state, name, sending, recving) -> None:
        step = self.worker_step
        n = 0
        flat, state.flat = state.flat, None
        for direction, rid, blocks in flat or ():  # the copies this call launched (they run on)
            n += 1
            tokens = blocks * state.block_size
            self._row(t0, t1, step, state, name, direction, rid, None,
                      tokens * sum(state.token_bytes.values()) if state.token_bytes else None, tokens)
        for direction, ids in (("save", sending), ("load", recving)):
            for rid in ids or ():
                n += 1
                self._row(t0, t1, step, state, name, direction, rid)
        if not n:
            self._row(t0, t1, step, state, name, "other")

    def _w_get_finished(self, method, state):
        def wrapper(*args, **kwargs):
            def record(t0, t1, result):
                sending, recving = result if isinstance(result, tuple) else (None, None)
                self._done_rows(t0, t1, state, "get_finished", sending, recving)
            return self._call(method, record, args, kwargs)
        return wrapper

    def _w_get_transfer_results(self, method, state):
        def wrapper(*args, **kwargs):
            def record(t0, t1, result):
                self._done_rows(t0, t1, state, "get_transfer_results",
                                getattr(result, "finished_sending", None),
                                getattr(result, "finished_recving", None))
            return self._call(method, record, args, kwargs)
        return wrapper


def block_lists(meta: Any) -> list[tuple] | None:
    """[(direction, request_id or None, blocks)] for metadata that lists the GPU blocks to store and to
    load (SimpleCPUOffloadConnector's `store_gpu_blocks` / `load_gpu_blocks`, copied when the worker's
    `get_finished` runs); None for any other metadata. A load names its request when it is one
    request's; stores name none (the worker is never told whose blocks they are)."""
    store, load = getattr(meta, "store_gpu_blocks", None), getattr(meta, "load_gpu_blocks", None)
    if not isinstance(store, (list, tuple)) or not isinstance(load, (list, tuple)):
        return None
    out = []
    if store:
        out.append(("save", None, len(store)))
    if load:
        reqs = (getattr(meta, "load_event_to_reqs", None) or {}).get(getattr(meta, "load_event", None)) or []
        out.append(("load", str(reqs[0]) if len(reqs) == 1 else None, len(load)))
    return out


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """A wrapped method's argument by position or name (callers use both)."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _written_slots(attn_metadata: Any) -> int | None:
    """Slots a layer writes this step: the unpadded token count (a host int, no device sync)."""
    n = getattr(attn_metadata, "num_actual_tokens", None)
    if n is None:
        sm = getattr(attn_metadata, "slot_mapping", None)
        n = None if sm is None else len(sm)
    return None if n is None else int(n)


def tensor_token_bytes(kv_layer: Any, state: _Conn) -> int | None:
    """Fallback for a layer missing from the KV cache spec: the layer tensor's bytes per slot."""
    slots = state.num_blocks * state.block_size
    try:
        return int(kv_layer.numel() * kv_layer.element_size()) // slots if slots else None
    except Exception:
        return None
