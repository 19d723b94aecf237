# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
# Both set up .venv first (scripts/setup.sh, idempotent).
VENV ?= .venv
export MINITE_VENV := $(VENV)

.PHONY: setup demo test lint format

setup:
	@scripts/setup.sh

demo: setup
	$(VENV)/bin/minite demo

test: setup
	$(VENV)/bin/python -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
