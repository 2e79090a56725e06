"""State shared by the probes of one EngineCore process (plain attributes: read on hot paths).

`step` is the engine step being scheduled or finished; `request_id` is the request a KV-cache-manager
call is being made for, so block-pool events (which do not see requests) can be attributed.
"""


class EngineContext:
    __slots__ = ("step", "request_id")

    def __init__(self) -> None:
        self.step = 0
        self.request_id: str | None = None


ctx = EngineContext()
