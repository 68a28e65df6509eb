# dedloc: `make demo` runs a local collaboration, `make test` runs every test. Both set themselves up first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch first and alone: a CPU wheel of 2.13.0 lies on local disk; letting hivemind pull torch would fetch CUDA.
# pip compiles bytecode on one core; compileall on every core afterwards saves ~10 s of set-up here (a few files,
# like torch's Python 3.12 samples, cannot compile on 3.11: they only stay uncompiled, so that status is ignored).
$(STAMP): constraints.txt pyproject.toml worker/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q --no-compile -c constraints.txt -e worker -e '.[test]'
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null || true
	touch $@

demo: setup
	$(BIN)/dedloc demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var test-output
