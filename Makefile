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
# once per worker); the slowest tests are listed so regressions in test time show up. The
# docker sandbox tests need a Docker engine: the local one is started first if none answers
# (no bridge network, no iptables rules; see envs/sandbox/docker_engine.py), unless
# ARBOR_SKIP_DOCKER=1 says this machine cannot run Docker (the docker tests then skip).
test: $(VENV)/.stamp
	[ "$$ARBOR_SKIP_DOCKER" = 1 ] || $(PY) -m envs.sandbox.docker_engine
	@# The Debian bases the tests' environments and sandboxes start from (cached by content:
	@# built once per machine, ~25 s each): the bundled tasks' bookworm-pytest, pip's, bare.
	docker=both; [ "$$ARBOR_SKIP_DOCKER" = 1 ] && docker=bwrap; \
	$(PY) -m envs.environments base --packages python3-pytest --backend $$docker && \
	$(PY) -m envs.environments base --packages python3-pip,python-is-python3 --backend $$docker && \
	$(PY) -m envs.environments base --backend bwrap
	@# The agent CLIs the scaffold tests run, installed into the environments they use (npm and
	@# PyPI downloads; cached by content: ~4 min on a fresh machine, then found at once).
	$(PY) -m envs.scaffolds build mini-swe-agent && \
	$(PY) -m envs.scaffolds build claude-code codex mini-swe-agent
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(TESTS) $(PYTEST_ARGS)

venv: $(VENV)/.stamp

# Rebuilt whenever the dependency lists change, or a top-level package appears (the editable
# install maps package names when it is made).
$(VENV)/.stamp: setup.py requirements-lock.txt $(wildcard */__init__.py)
	@# Sandboxes run in bubblewrap (the verifier runs the sandbox's system python3 with pytest)
	@# under a seccomp filter compiled with libseccomp, each exec in a fresh session keyring
	@# (a one-line perl launcher);
	@# the RL queue tests start their own redis-server; openssl makes their TLS certificates;
	@# the docker backend runs on Debian's Docker engine (docker.io), its images and the task
	@# root filesystems are built from Debian packages with mmdebstrap.
	@# Only what is missing is installed (--no-upgrade: nothing already there changes), and the
	@# redis-server and docker services are neither started nor enabled at boot (Debian's
	@# dockerd would make a bridge network and firewall rules: Arbor starts its own without).
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v unshare >/dev/null || missing="$$missing util-linux"; \
	command -v perl >/dev/null || missing="$$missing perl-base"; \
	{ ls /usr/lib/*/libseccomp.so.2 || ls /lib/*/libseccomp.so.2; } >/dev/null 2>&1 || \
		missing="$$missing libseccomp2"; \
	/usr/bin/python3 -c "import pytest" 2>/dev/null || missing="$$missing python3-pytest"; \
	command -v dockerd >/dev/null || missing="$$missing docker.io"; \
	command -v mmdebstrap >/dev/null || missing="$$missing mmdebstrap"; \
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
		if echo "$$missing" | grep -q docker.io; then \
			$(SUDO) update-rc.d docker disable >/dev/null 2>&1 || true; \
			! command -v systemctl >/dev/null || \
				$(SUDO) systemctl disable docker.service docker.socket >/dev/null 2>&1 || true; \
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
