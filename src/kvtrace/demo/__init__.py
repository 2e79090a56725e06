"""The demo: a tiny offline Llama (model.py), a multi-turn workload that hits the prefix cache and forces
preemptions (workload.py), and `kvtrace demo` (run.py) recording, ingesting and viewing it."""

from kvtrace.demo.run import run_demo

__all__ = ["run_demo"]
