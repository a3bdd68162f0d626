# Two commands do everything: `make demo` and `make test`. Both create .venv and install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ROOT := $(CURDIR)

# The project's environment (AIRFLOW_HOME, the DAG and plugin folders, MLFLOW_TRACKING_URI, PYTHONPATH,
# gloo on loopback, no telemetry) is written once, in scripts/project_env.py: the scripts apply it
# themselves (so the README's commands work from any shell), the other commands here run through it.
# A variable set in your shell wins.
WITH_ENV := $(BIN)/python scripts/project_env.py

.PHONY: install system-packages demo test test-fast airflow-up airflow-down mlflow-ui compare screenshots chromium podman prometheus images stack-check clean help docs

help:
	@echo "make demo         install (first time), make data, run one full DAG run, print where to look"
	@echo "make test         install (first time) and run the test suite"
	@echo "make test-fast    the loop while editing: unit and contract tests, no Python child process but one torchrun (< 4 min)"
	@echo "make airflow-up   start the Airflow web UI + scheduler on 127.0.0.1:8080 (admin password printed)"
	@echo "make airflow-down stop them"
	@echo "make mlflow-ui    MLflow UI on 127.0.0.1:5000 over the project's tracking store"
	@echo "make compare      comparison report of the last LAST=10 runs of EXPERIMENT=distributed_training"
	@echo "make screenshots  refresh docs/images/ from the headless-browser test of the web UI"
	@echo "make images       build the training and Airflow images (IMAGE_BASE=debian: CPU training image, no registry)"
	@echo "make stack-check  docker-compose.yaml up for real with podman, one DAG run through the REST API, checks, down"

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, alone: pip then takes the CPU build and never resolves a CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt -c constraints.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# Three pytest-xdist workers on the 2-core machine: much of the time tests wait on child processes,
# servers and containers (two workers kept the CPUs 79% busy; three finish in 12 minutes instead of
# 14). tests/conftest.py keeps the live stack and the image on one worker each.
# The Python packages and the Debian ones (system-packages) install side by side: one waits on
# pip's unpacking, the other on dpkg's, and a fresh machine is ready a minute or two sooner.
PYTEST_WORKERS ?= 3
test:
	$(MAKE) -s -j 2 $(STAMP) system-packages
	$(WITH_ENV) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=30

# The loop to run while editing: every test not marked slow. TEST_CHILD_PROCESSES=refuse (tests/processes.py)
# fails a test here that starts a Python process (a server, a script, torchrun), except the one marked
# smoke_torchrun, so the loop stays under four minutes. Mark a test that needs one slow.
test-fast: $(STAMP) prometheus
	TEST_CHILD_PROCESSES=refuse $(WITH_ENV) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" --durations=15

# What make test needs from Debian (chromium, podman with mmdebstrap, prometheus), in one apt-get
# pass: the targets below each install one part when missing, for the commands that need only it.
system-packages:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	{ command -v podman >/dev/null && command -v mmdebstrap >/dev/null; } || missing="$$missing $(PODMAN_PACKAGES)"; \
	{ command -v promtool >/dev/null && command -v prometheus >/dev/null; } || missing="$$missing prometheus"; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$missing (apt-get) for the web-UI, image, pod and metrics tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $$missing >/dev/null; \
	else \
	  echo "missing for make test:$$missing (Debian/Ubuntu: sudo apt-get install -y$$missing), then run make test again"; \
	  exit 1; \
	fi

# The web-UI test drives Debian's chromium headless. Installed here when missing and we may.
chromium:
	@command -v chromium >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium (apt-get) for the web-UI test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
	  echo "chromium is missing: install it (Debian/Ubuntu: sudo apt-get install -y chromium), then run make test again"; \
	  exit 1; \
	fi

# The alert-rule tests run promtool and the live-metrics test a real Prometheus server (Debian's
# prometheus package has both). Installed here when missing and we may.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing prometheus (apt-get) for the alert-rule and live-metrics tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else \
	  echo "prometheus is missing: install it (Debian/Ubuntu: sudo apt-get install -y prometheus), then run make test again"; \
	  exit 1; \
	fi

# The image and pod tests (tests/e2e/test_images.py, test_pods.py) build and run containers with
# podman (as root: runc, native overlay; settings in docker/podman/) and make their base image from
# Debian packages with mmdebstrap. Installed here when missing and we may.
PODMAN_PACKAGES := podman runc fuse-overlayfs uidmap slirp4netns catatonit iptables mmdebstrap \
	containernetworking-plugins golang-github-containernetworking-plugin-dnsname dnsmasq-base
podman:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing podman and mmdebstrap (apt-get) for the image and pod tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(PODMAN_PACKAGES) >/dev/null; \
	else \
	  echo "podman is missing: install it (Debian/Ubuntu: sudo apt-get install -y $(PODMAN_PACKAGES)), then run make test again"; \
	  exit 1; \
	fi

# `make images`: the training image on the CUDA runtime (default) or on a Debian base made here
# from packages (IMAGE_BASE=debian, the CPU variant the tests run), and the Airflow image.
IMAGE_BASE ?= cuda
IMAGES ?= training airflow
images: $(STAMP)
	$(BIN)/python scripts/images.py --base $(IMAGE_BASE) $(IMAGES)

# `make stack-check`: the compose stack up for real (podman; stand-ins for the registry images where
# none is reachable), the README's steps, one DAG run through the REST API, its MLflow run and
# checkpoint checked, the stack and its volumes removed. By hand, not in `make test`: 6 to 8
# minutes on two cores the first time, under 3 after (docs/operations.md).
stack-check: $(STAMP) podman
	$(WITH_ENV) $(BIN)/python scripts/stack_check.py

EXPERIMENT ?= distributed_training
LAST ?= 10
compare: $(STAMP)
	$(WITH_ENV) $(BIN)/python -m training compare --experiment $(EXPERIMENT) --last $(LAST) --out var/reports/$(EXPERIMENT)
	@echo "open var/reports/$(EXPERIMENT)/report.html"

screenshots: $(STAMP) chromium
	UPDATE_SCREENSHOTS=1 $(WITH_ENV) $(BIN)/python -m pytest -q tests/e2e/test_live_ui.py tests/e2e/test_live_sweep.py

airflow-up: $(STAMP)
	$(BIN)/python scripts/airflow_local.py up

airflow-down:
	$(BIN)/python scripts/airflow_local.py down

# The store's tables are created first under the lock the tasks take (training_airflow.settings):
# a server creating them itself races with tasks that start at the same time.
mlflow-ui: $(STAMP)
	mkdir -p var/mlflow
	$(WITH_ENV) $(BIN)/python -c "from training_airflow import settings; settings.ensure_tracking_uri()"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(WITH_ENV) sh -c 'exec $(BIN)/mlflow server --host 127.0.0.1 \
	  --port 5000 --backend-store-uri "$$MLFLOW_TRACKING_URI" --default-artifact-root $(ROOT)/var/mlflow/artifacts'

clean:
	rm -rf var .airflow

# The configuration tables of README.md and docs/configuration.md, from the declared fields.
docs: $(STAMP)
	$(BIN)/python scripts/config_docs.py
