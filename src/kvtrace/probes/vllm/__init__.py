"""The vLLM probes: one module per part of vLLM they patch, installed by `plugin.register()`.

`PROBES` lists them, in install order: (module, class). A probe whose module does not import is
recorded as failed in the session; the others install as usual. Version differences between vLLM
releases are handled inside each probe's `targets()` (what it patches, and which of its hooks are
required): see docs/architecture.md, "Adding a vLLM version or runner".
"""

PROBES = (
    ("kvtrace.probes.vllm.scheduler", "SchedulerProbe"),
    ("kvtrace.probes.vllm.kv_blocks", "BlockPoolProbe"),
    ("kvtrace.probes.vllm.kv_blocks", "PrefixCacheProbe"),
    ("kvtrace.probes.vllm.connector", "ConnectorProbe"),
    ("kvtrace.probes.vllm.attention", "AttentionProbe"),
    ("kvtrace.probes.vllm.engine_stop", "EngineStopProbe"),
)
