# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install what they need; the install is redone only when
# pyproject.toml changes.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.k3-installed
# DeepSpeed's C++ ops (the CPU shm all-reduce, cpu_adam) build once into torch's default directory
# (~/.cache/torch_extensions/<py>_<device>, or TORCH_EXTENSIONS_DIR when set), the one every way of
# starting k3 shares: make, the README's cluster jobs from a new terminal, the tests.
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

.PHONY: venv demo test test-fast lint bench bench-kernels prometheus chromium clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned to the CPU wheel that lies on this machine's disk; installing it first
	# keeps any later dependency from pulling a multi-GB CUDA build.
	$(BIN)/python -m pip install -q --no-compile "torch==2.13.0"
	$(BIN)/python -m pip install -q --no-compile -e ".[test,ray,bench,monitor]"
	# Byte-compiled on every core (pip compiles on one: 95 of a fresh install's 164 s here). A file
	# that does not compile on this Python (torch ships one for 3.12) is skipped, as pip skips it.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# Prometheus from Debian's package, without root: used from PATH when there, else unpacked into
# .cache/prometheus (k3.platform.ops.prometheus looks in both places).
PROM_DIR := .cache/prometheus
$(PROM_DIR)/.installed:
	mkdir -p $(PROM_DIR)
	if command -v prometheus >/dev/null; then touch $@; else \
	  (apt-get download prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get download prometheus)) && \
	  mv prometheus_*.deb $(PROM_DIR)/ && dpkg-deb -x $(PROM_DIR)/prometheus_*.deb $(PROM_DIR)/root && \
	  $(PROM_DIR)/root/usr/bin/prometheus --version >/dev/null && touch $@; fi

prometheus: $(PROM_DIR)/.installed

# Chromium's headless shell for the run report's browser test (tests/platform/test_report.py):
# used from PATH when there, else Debian's package and the libraries this machine lacks, unpacked
# into .cache/chromium without root (.ci/fetch-chromium).
CHROME_DIR := .cache/chromium
$(CHROME_DIR)/.installed:
	if command -v chromium-headless-shell >/dev/null; then mkdir -p $(CHROME_DIR) && touch $@; else .ci/fetch-chromium; fi

chromium: $(CHROME_DIR)/.installed

demo: $(STAMP) $(PROM_DIR)/.installed
	$(BIN)/python jobs/demo.py

lint: $(STAMP)
	.ci/lint-imports

# The unit tier: no Ray cluster, no spawned training processes, nothing slow (markers in
# pyproject.toml). It runs on both cores, a file per worker and one torch thread each; the rest
# (Ray clusters, process groups, the README's jobs: each of those uses both cores itself) after
# it, one test at a time. Each pytest run fails when no test in it ran and passed.
UNIT := not ray and not distributed and not slow

test: $(STAMP) $(PROM_DIR)/.installed $(CHROME_DIR)/.installed
	.ci/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=10 -m "$(UNIT)" tests
	$(BIN)/python -m pytest -q --durations=20 -m "not ($(UNIT))" tests

# The unit tier alone, for the inner loop. CI runs `make test`. Its alerting-rule and monitor
# tests run promtool and Prometheus, and the report's browser test Chromium: a fresh clone's
# `make test-fast` failed 8 tests without them.
test-fast: $(STAMP) $(PROM_DIR)/.installed $(CHROME_DIR)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=10 -m "$(UNIT)" tests

bench: $(STAMP)
	$(BIN)/python jobs/bench_model.py

# The kernel benchmark's CPU peers (transformers is in the test extra already; fla goes into a
# folder of its own, without its dependencies: with fla importable, transformers' Kimi Linear
# routes to fla's Triton kernels, which cannot run on a CPU, so it stays out of .venv).
FLA_DIR := .cache/fla-bench
$(FLA_DIR)/.installed:
	$(BIN)/python -m pip install -q --no-deps --target $(FLA_DIR) "flash-linear-attention==0.6.0" "fla-core==0.6.0"
	touch $@

bench-kernels: $(STAMP) $(FLA_DIR)/.installed
	PYTHONPATH=$(FLA_DIR) $(BIN)/python jobs/bench_kernels.py

clean:
	rm -rf $(VENV) .cache
