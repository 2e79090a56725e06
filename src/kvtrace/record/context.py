"""State shared by the probes of one EngineCore process (plain attributes: read on hot paths).

`step` is the engine step being scheduled or finished; `request_id` is the request a KV-cache-manager
call is being made for, so block-pool events (which do not see requests) can be attributed.
"""

import time


class EngineContext:
    __slots__ = ("step", "request_id", "utc_minus_mono_ns")

    def __init__(self) -> None:
        self.step = 0
        self.request_id: str | None = None
        # vLLM stamps arrival with time.time(); this maps it onto our monotonic clock.
        self.utc_minus_mono_ns = time.time_ns() - time.monotonic_ns()


ctx = EngineContext()
