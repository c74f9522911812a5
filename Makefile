# TaskHet: `make demo` runs the main job, `make test` the test suite; both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DATA ?= data/synthetic

.PHONY: setup demo test bench download clean

setup: $(STAMP)

# Re-installs only when a requirements file changes.
$(STAMP): requirements.txt requirements-flower.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt -r requirements.txt
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt -r requirements-flower.txt
	touch $(STAMP)

demo: setup
	$(PY) run_pipeline.py experiments/demo.yaml

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt -r bench/requirements.txt
	for script in bench/bench_*.py; do $(PY) $$script || exit 1; done

# Real Taskonomy via omnidata-tools (needs internet). SUBSET=debug|tiny|medium|full|fullplus
SUBSET ?= tiny
download: setup
	$(PY) download_taskonomy.py --subset $(SUBSET) --dest data/taskonomy

clean:
	rm -rf results/* data/synthetic
