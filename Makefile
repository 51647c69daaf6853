# `make test` and `make demo` work on a fresh Debian/Ubuntu machine: the first run installs
# the Debian packages and the virtualenv, later runs reuse them (see .venv/.stamp).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TESTS ?= tests
PYTEST_ARGS ?=
# apt-get needs root; elsewhere go through sudo (and fail loudly if that is not possible).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test venv clean

# The README's main job: tokenizer -> SFT -> RL -> held-out eval per seed (configs/demo.py).
# Its figures then join their history (docs/benchmarks_history.jsonl), compared with the best
# recorded on this kind of machine (benchmarks/check.py).
demo: $(VENV)/.stamp
	$(PY) -m trainer.main --config=configs/demo.py --workdir=/tmp/arbor_demo
	$(PY) -m benchmarks.check --only= --demo_results=/tmp/arbor_demo/demo_results.json --record

# Two xdist workers, each taking whole files (a module's compiled fixtures are built once, not
# once per worker); the slowest tests are listed so regressions in test time show up.
test: $(VENV)/.stamp
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 $(TESTS) $(PYTEST_ARGS)

venv: $(VENV)/.stamp

# Rebuilt whenever the dependency lists change, or a top-level package appears (the editable
# install maps package names when it is made).
$(VENV)/.stamp: setup.py requirements-lock.txt $(wildcard */__init__.py)
	@# Sandboxes run in bubblewrap (the verifier runs the sandbox's system python3 with pytest)
	@# under a seccomp filter compiled with libseccomp, each exec in a fresh session keyring
	@# (a one-line perl launcher);
	@# the RL queue tests start their own redis-server; openssl makes their TLS certificates.
	@# Only what is missing is installed (--no-upgrade: nothing already there changes), and the
	@# redis-server service is neither started nor enabled at boot.
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v unshare >/dev/null || missing="$$missing util-linux"; \
	command -v perl >/dev/null || missing="$$missing perl-base"; \
	{ ls /usr/lib/*/libseccomp.so.2 || ls /lib/*/libseccomp.so.2; } >/dev/null 2>&1 || \
		missing="$$missing libseccomp2"; \
	/usr/bin/python3 -c "import pytest" 2>/dev/null || missing="$$missing python3-pytest"; \
	if [ -n "$$missing" ]; then \
		echo "Installing the missing Debian packages:$$missing"; \
		policy=""; [ -e /usr/sbin/policy-rc.d ] || policy=/usr/sbin/policy-rc.d; \
		[ -z "$$policy" ] || printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee $$policy >/dev/null; \
		[ -z "$$policy" ] || $(SUDO) chmod +x $$policy; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade $$missing; \
		status=$$?; [ -z "$$policy" ] || $(SUDO) rm -f $$policy; \
		if echo "$$missing" | grep -q redis-server; then \
			$(SUDO) update-rc.d redis-server disable >/dev/null 2>&1 || true; \
			! command -v systemctl >/dev/null || $(SUDO) systemctl disable redis-server >/dev/null 2>&1 || true; \
		fi; \
		exit $$status; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(VENV)/bin/pip install -r requirements-lock.txt
	$(VENV)/bin/pip install --no-deps -e .
	touch $@

# Keeps .venv (slow to rebuild); `rm -rf .venv` for a fresh one.
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis $(VENV)/.stamp
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
