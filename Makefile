# dedloc: `make demo` runs a local collaboration, `make test` runs every test. Both set themselves up first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WHEELS := app/wheels/.built

.PHONY: setup demo test test-soak check bench bench-gpu clean

# The wheels the portal serves to volunteers; an installed portal carries them (setup.py builds them the same way).
WHEEL_SOURCES := $(shell find common worker -name '*.py' -o -name pyproject.toml 2>/dev/null)
$(WHEELS): $(STAMP) $(WHEEL_SOURCES)
	rm -rf app/wheels
	$(BIN)/python -c "import pathlib, runpy; runpy.run_path('setup.py')['build_volunteer_wheels'](pathlib.Path('app/wheels'))" >/dev/null
	touch $@

setup: $(STAMP) $(WHEELS)

# torch first and alone: a CPU wheel of 2.13.0 lies on local disk; letting hivemind pull torch would fetch CUDA.
# pip compiles bytecode on one core; compileall on every core afterwards saves ~10 s of set-up here (a few files,
# like torch's Python 3.12 samples, cannot compile on 3.11: they only stay uncompiled, so that status is ignored).
$(STAMP): constraints.txt pyproject.toml setup.py worker/pyproject.toml common/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q --no-compile -c constraints.txt -e '.[test]'
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null || true
	touch $@

demo: setup
	$(BIN)/dedloc demo

# Two passes, both always run: the tests that start no swarm in parallel (pytest-xdist; a file stays on one process,
# so its module fixtures are built once), one process more than the cores as they spend much of their time waiting on
# the portals and CLIs they start (on 2 cores: 180 s with 3 processes, 296 s with 2, 231 s with 4); then the swarm
# tests one at a time with the machine to themselves (their rounds and timeouts are sized for that).
TEST_PROCESSES ?= $(shell echo $$(( $$(nproc) + 1 )))
test: setup
	$(BIN)/python -m pytest -m "not swarm" -n $(TEST_PROCESSES) --dist loadfile; first=$$?; \
	$(BIN)/python -m pytest -m "swarm and not soak"; second=$$?; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]

# The soak bench's 5-minute variant (tests/test_soak.py, about 6 minutes): make test takes 17-18 of its 20 minutes
# without it, so it runs here until the swarm pass makes room.
test-soak: setup
	$(BIN)/python -m pytest -m soak

# Lint everything (ruff, configured in pyproject.toml), type-check common/ and app/ (mypy); CI runs it before the tests.
check: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m bench

# The GPU path on a CUDA machine, sized for 8 minutes on an H100 but not yet run on one (bench/results/gpu.md); one line and exit
# code 2 where torch has no CUDA. Its CPU half runs in `make bench`.
bench-gpu: setup
	$(BIN)/python -m bench.gpu --device cuda

clean:
	rm -rf $(VENV) var test-output
