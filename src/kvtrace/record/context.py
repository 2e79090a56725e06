"""State shared by the probes of one EngineCore process (plain attributes: read on hot paths).

`step` is the engine step being scheduled or finished; `request_id` is the request a KV-cache-manager
call is being made for, so block-pool events (which do not see requests) can be attributed;
`connector` names the KV connector whose method is running (scheduler side), so the block-pool calls
it makes are told apart as its holds.
"""


class EngineContext:
    __slots__ = ("step", "request_id", "connector")

    def __init__(self) -> None:
        self.step = 0
        self.request_id: str | None = None
        self.connector: str | None = None


ctx = EngineContext()
