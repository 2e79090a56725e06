"""Recording: `kvtrace record` (launch.py, signals.py) and the recorder inside every traced process.

    launch.py    runs the command with the session in its environment; finalises the manifest
    signals.py   "flush now" (SIGUSR2) and waiting for the recorded process group
    recorder.py  one per process: row buffers, the background shard writer, drops, proc.json
    buffers.py   the hot-path row logs (and their C twin, _columns.c) the probes append to
    context.py   the engine step and request that block-pool rows are stamped with
    clocks.py    the monotonic and wall clocks read as one pair (anchors, request arrivals)

Imports format/ only; the probes build on it.
"""
