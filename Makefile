# One command each: `make demo` sets up and runs the demo; `make test` sets up and runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test demo test lint bench schema-doc

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup
	$(VENV)/bin/kvtrace demo -o demo

test: setup-test
	$(PY) -m pytest -q -rs

lint:
	$(VENV)/bin/ruff check src tests bench scripts

bench:
	$(PY) bench/bench_overhead.py

schema-doc:
	$(PY) -m kvtrace.store.schema_doc > docs/schema.md
