# One command each: `make demo` sets up and runs the demo; `make test` sets up and runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test demo test test-versions test-source-versions lint bench schema-doc support-doc

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup
	$(VENV)/bin/kvtrace demo -o demo

# Other releases of vLLM's CPU build: the real-engine exactness tests run on each, in its own venv layered
# on $(VENV) (only vLLM and what it pins differ). Under CI, each is deleted after its run to keep the disk.
VLLM_VERSIONS ?= 0.27.0 0.30.0

test: setup-test
	$(PY) -m pytest -q -rs
	$(MAKE) test-versions
	$(MAKE) test-source-versions

test-versions:
	@for v in $(VLLM_VERSIONS); do \
		echo "== vLLM $$v: the exactness tests" >&2; \
		KVTRACE_VENV=$(VENV)-$$v KVTRACE_VLLM=$$v KVTRACE_BASE_VENV=$(VENV) PIP_NO_CACHE_DIR=1 \
			bash scripts/setup.sh --test || exit 1; \
		$(VENV)-$$v/bin/python -m pytest -q -rs -m exactness tests/integration || exit 1; \
		if [ -n "$$CI" ]; then rm -rf $(VENV)-$$v; fi; \
	done

# Releases with no CPU build: their CUDA wheel alone, layered on $(VENV); vLLM's own Scheduler and KV
# cache manager, driven without a model on the CPU, against the probes (tests/helpers/driven_scheduler.py).
VLLM_SOURCE_VERSIONS ?= 0.33.0
DRIVEN_TESTS := tests/integration/test_host_exactness.py tests/integration/test_bench_host_steps.py \
	tests/integration/test_offload_pools.py

test-source-versions:
	@for v in $(VLLM_SOURCE_VERSIONS); do \
		echo "== vLLM $$v (CUDA wheel, no engine): the driven-scheduler tests" >&2; \
		KVTRACE_VENV=$(VENV)-$$v KVTRACE_VLLM=$$v KVTRACE_VLLM_BUILD=cuda KVTRACE_BASE_VENV=$(VENV) \
			PIP_NO_CACHE_DIR=1 bash scripts/setup.sh || exit 1; \
		VLLM_TARGET_DEVICE=cpu $(VENV)-$$v/bin/python -m pytest -q -rs -m "not vllm" $(DRIVEN_TESTS) || exit 1; \
		if [ -n "$$CI" ]; then rm -rf $(VENV)-$$v; fi; \
	done

lint:
	$(VENV)/bin/ruff check src tests bench scripts

bench:
	$(PY) bench/bench_overhead.py

schema-doc:
	$(PY) -m kvtrace.store.schema_doc > docs/schema.md

support-doc:
	$(PY) -m kvtrace.probes.vllm.doctor --table tests/data/vllm_skeletons/*.json > docs/vllm-support.md
