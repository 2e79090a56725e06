"""Reading the monotonic clock (which every row is stamped with) and the wall clock as one pair.

Two clock reads in a row are normally ~100 ns apart, but the thread can lose the GIL or the CPU between
them (the switch interval is 5 ms; the shard writer and vLLM's own threads run beside the engine), and a
pair taken across such a pause puts every time derived from it off by the pause. `clock_pair` reads the
wall clock on both sides of the monotonic one and keeps the tightest of a few tries.
"""

import time

TIGHT_NS = 20_000  # a pair whose wall reads are this close is kept at once
TRIES = 4


def clock_pair(mono=time.monotonic_ns, wall=time.time_ns) -> tuple[int, int]:
    """(monotonic ns, wall ns) read together: the wall time is the midpoint of the two wall reads around
    the monotonic read, from the try with the least time between them."""
    best = None
    for _ in range(TRIES):
        w0 = wall()
        m = mono()
        w1 = wall()
        gap = w1 - w0 if w1 >= w0 else float("inf")  # the wall clock stepped back between the reads
        if best is None or gap < best[0]:
            best = (gap, m, w0 + (w1 - w0) // 2)
        if gap <= TIGHT_NS:
            break
    return best[1], best[2]
