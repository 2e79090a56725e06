"""Probes: patches installed into vLLM processes through its general-plugin entry point."""
