-- name: fragmentation
-- description: Per step: token slots allocated (blocks held x block size) vs tokens stored by the requests holding KV, and the memory waste % (block-size lab's internal fragmentation).
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, rank, step, block_size (tokens per block), requests (requests holding blocks after the step's schedule()), tokens_stored (tokens, their computed tokens once the step ran), blocks_held (blocks, summed over those requests), allocated_slots (token slots, blocks_held x block_size), wasted_slots (token slots, allocated - stored), waste_pct (%, wasted / allocated), device_blocks_used (blocks in use in the pool, shared prefix blocks counted once)
-- A request holds KV from the step it is scheduled new (or resumed after a preemption) to the last step
-- it is scheduled before it finishes or is preempted. Its blocks = all blocks the scheduler gave it then
-- (prefix hits included) plus those added in later steps (step_requests.new_blocks); its tokens stored
-- = computed_before at that first step plus the tokens scheduled since. Shared prefix blocks count once
-- per request holding them (the per-request view the lab uses); device_blocks_used counts them once.
WITH sr AS (
    SELECT session, rank, step, request_id, tokens, computed_before, new_blocks
    FROM step_requests WHERE $session IS NULL OR session = $session
), pre AS (  -- requests preempted at least once: their rows are split into epochs (few rows)
    SELECT DISTINCT session, rank, request_id FROM preemptions WHERE $session IS NULL OR session = $session
), ep AS (
    SELECT sr.*, 0 AS epoch FROM sr ANTI JOIN pre USING (session, rank, request_id)
    UNION ALL
    SELECT session, rank, step, request_id, tokens, computed_before, new_blocks,
        sum(CASE WHEN kind IN ('new', 'resumed') THEN 1 ELSE 0 END)
            OVER (PARTITION BY session, rank, request_id ORDER BY step) AS epoch
    FROM step_requests x SEMI JOIN pre USING (session, rank, request_id)
), e AS (  -- one row per request epoch: when it started and ended, what it held in all
    SELECT session, rank, min(step) AS first_step, max(step) AS last_step,
        sum(new_blocks) AS blocks, arg_min(computed_before, step) + sum(tokens) AS stored,
        arg_min(computed_before, step) AS start_tokens
    FROM ep GROUP BY session, rank, request_id, epoch
), d AS (  -- per-step deltas: + what starts or grows at s, - what ended at s - 1
    SELECT session, rank, step, sum(new_blocks) AS blocks, sum(tokens) AS tokens, 0 AS reqs
    FROM sr GROUP BY ALL
    UNION ALL
    SELECT session, rank, first_step, 0, sum(start_tokens), count(*) FROM e GROUP BY ALL
    UNION ALL
    SELECT session, rank, last_step + 1, -sum(blocks), -sum(stored), -count(*) FROM e GROUP BY ALL
), c AS (
    SELECT session, rank, step,
        sum(sum(blocks)) OVER w AS held, sum(sum(tokens)) OVER w AS stored, sum(sum(reqs)) OVER w AS requests
    FROM d GROUP BY session, rank, step
    WINDOW w AS (PARTITION BY session, rank ORDER BY step)
)
SELECT
    s.session,
    s.rank,
    s.step,
    ss.block_size,
    coalesce(c.requests, 0)::BIGINT AS requests,
    coalesce(c.stored, 0)::BIGINT AS tokens_stored,
    coalesce(c.held, 0)::BIGINT AS blocks_held,
    (coalesce(c.held, 0) * ss.block_size)::BIGINT AS allocated_slots,
    (coalesce(c.held, 0) * ss.block_size - coalesce(c.stored, 0))::BIGINT AS wasted_slots,
    100.0 * (c.held * ss.block_size - c.stored) / nullif(c.held * ss.block_size, 0) AS waste_pct,
    s.kv_blocks_used AS device_blocks_used
FROM steps s
LEFT JOIN sessions ss ON ss.session = s.session
ASOF LEFT JOIN c ON c.session = s.session AND c.rank = s.rank AND c.step <= s.step
WHERE $session IS NULL OR s.session = $session
ORDER BY s.session, s.rank, s.step;
