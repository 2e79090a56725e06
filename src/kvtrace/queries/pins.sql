-- name: pins
-- description: Each pin or hold of KV against eviction: how long it was held, how it ended, and whether the pinned KV was reused before it ended.
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, request_id (owner of the pinned KV), kind (pin | hold), reason (policy or connector), step (step it started), t_s (s since the session's first step), end_event (unpin | expire | release; null while still held at the end of the trace), held_ms (ms, start -> end; null when never ended), ttl_ms (ms, the pin's time-to-live, when the policy has one), blocks (count), reuse_events (count of 'reuse' rows for the owner while held), hit_requests (other requests whose prefix hits touched the pinned blocks while held), reused (true when either is > 0), first_reuse_ms (ms, start -> first reuse or hit), expired (true when it ended by TTL expiry)
-- empty: no block was pinned or held by a connector
-- A pin (pin -> unpin | expire) comes from a pinning scheduler through kvtrace.probes.pins; a hold
-- (hold -> release) is a connector delaying the free of a finished request's blocks.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), ev AS (
    SELECT *, CASE WHEN event IN ('pin', 'unpin', 'expire') THEN 'pin' ELSE 'hold' END AS kind
    FROM pins WHERE $session IS NULL OR session = $session
), st AS (
    SELECT *, row_number() OVER () AS pin_id FROM ev WHERE event IN ('pin', 'hold')
), en AS (
    SELECT session, request_id, kind, ts_ns AS end_ns, event AS end_event FROM ev
    WHERE event IN ('unpin', 'expire', 'release')
), iv AS (
    SELECT st.pin_id, st.session, st.request_id, st.kind, st.reason, st.step, st.ts_ns AS start_ns,
        st.ttl_ns, st.block_ids, en.end_ns, en.end_event
    FROM st ASOF LEFT JOIN en
      ON en.session = st.session AND en.request_id = st.request_id AND en.kind = st.kind
     AND en.end_ns >= st.ts_ns
), ru AS (
    SELECT iv.pin_id, count(*) AS reuse_events, min(e.ts_ns) AS first_ns
    FROM iv JOIN ev e
      ON e.session = iv.session AND e.request_id = iv.request_id AND e.event = 'reuse'
     AND e.ts_ns >= iv.start_ns AND (iv.end_ns IS NULL OR e.ts_ns <= iv.end_ns)
    GROUP BY iv.pin_id
), pb AS (
    SELECT pin_id, session, request_id, start_ns, end_ns, unnest(block_ids) AS block_id FROM iv
), hits AS (
    SELECT pb.pin_id, count(DISTINCT b.request_id) AS hit_requests, min(b.ts_ns) AS first_ns
    FROM pb JOIN block_events b
      ON b.session = pb.session AND b.block_id = pb.block_id AND b.event = 'touch'
     AND b.ts_ns >= pb.start_ns AND (pb.end_ns IS NULL OR b.ts_ns <= pb.end_ns)
     AND b.request_id IS DISTINCT FROM pb.request_id
    GROUP BY pb.pin_id
)
SELECT
    iv.session,
    iv.request_id,
    iv.kind,
    iv.reason,
    iv.step,
    round((iv.start_ns - o.t0) / 1e9, 6) AS t_s,
    iv.end_event,
    (iv.end_ns - iv.start_ns) / 1e6 AS held_ms,
    iv.ttl_ns / 1e6 AS ttl_ms,
    len(iv.block_ids) AS blocks,
    coalesce(ru.reuse_events, 0) AS reuse_events,
    coalesce(hits.hit_requests, 0) AS hit_requests,
    coalesce(ru.reuse_events, 0) + coalesce(hits.hit_requests, 0) > 0 AS reused,
    (least(ru.first_ns, hits.first_ns) - iv.start_ns) / 1e6 AS first_reuse_ms,
    coalesce(iv.end_event = 'expire', false) AS expired
FROM iv
LEFT JOIN origin o ON o.session = iv.session
LEFT JOIN ru ON ru.pin_id = iv.pin_id
LEFT JOIN hits ON hits.pin_id = iv.pin_id
ORDER BY iv.session, iv.start_ns, iv.request_id;
