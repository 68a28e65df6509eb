# dedloc: `make demo` runs a local collaboration, `make test` runs every test. Both set themselves up first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch first and alone: a CPU wheel of 2.13.0 lies on local disk; letting hivemind pull torch would fetch CUDA.
$(STAMP): constraints.txt pyproject.toml worker/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e worker -e '.[test]'
	touch $@

demo: setup
	$(BIN)/dedloc demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var test-output
