# TaskHet: `make demo` runs the main job, `make test` the test suite; both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs_installed
DATA ?= data/synthetic

.PHONY: paper-cpu mechanism privacy setup demo test test-kernels docs bench mutation download download-cifar clean setup-gpu gpu-check gpu-bench

HOOK_STAMP := $(VENV)/.torchvision_hook

setup: $(STAMP) $(HOOK_STAMP)

# pip installs uv, torch and torchvision (requirements-setup.txt): it reads the machine's own pip settings, such as a
# folder holding a local torch wheel, which uv does not. uv then installs the rest, compiling bytecode in parallel:
# about twice as fast as pip here (docs/BENCHMARKS.md). Where uv fails, pip installs the same files. Both hold every
# package to constraints.txt.
UV := $(VENV)/bin/uv
PIP_INSTALL := $(PIP) install --quiet --disable-pip-version-check -c constraints.txt
install = $(UV) pip install --quiet --python $(PY) --compile-bytecode -c constraints.txt $(1) || $(PIP_INSTALL) $(1)

# Re-installs only when a requirements file changes.
$(STAMP): requirements-setup.txt requirements.txt requirements-flower.txt requirements-flwr-datasets.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -r requirements-setup.txt
	$(call install,-r requirements.txt -r requirements-flower.txt -r requirements-flwr-datasets.txt)
	touch $(STAMP)

# `import torchvision` in any code run by the venv's Python (utils/torchvision_hook.py says how).
$(HOOK_STAMP): utils/torchvision_hook.py utils/tv_compat.py $(STAMP)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	cp utils/tv_compat.py $$site/taskhet_tv_compat.py && \
	cp utils/torchvision_hook.py $$site/taskhet_torchvision_hook.py && \
	echo "import taskhet_torchvision_hook" > $$site/taskhet_torchvision_hook.pth
	touch $(HOOK_STAMP)

# A GPU machine (docs/howto/gpu.md): the CUDA build of the pinned torch and torchvision, versions read from
# CONSTRAINTS so the two cannot drift, from PyTorch's wheel index for CUDA (torch 2.13: cu126, cu129, cu130 (PyPI's
# own CUDA), cu132). They go in first; `make setup` then keeps them: `2.13.0+cu130` satisfies the `==2.13.0` pin.
CUDA ?= cu130
TORCH_INDEX ?= https://download.pytorch.org/whl/$(CUDA)
CONSTRAINTS ?= constraints.txt
TORCH_PIN := $(shell sed -n 's/^torch==\([^ ;#]*\).*/\1/p' $(CONSTRAINTS))
TORCHVISION_PIN := $(shell sed -n 's/^torchvision==\([^ ;#]*\).*/\1/p' $(CONSTRAINTS))
setup-gpu:
	test -n "$(TORCH_PIN)" -a -n "$(TORCHVISION_PIN)" || { echo "error: $(CONSTRAINTS) pins no torch==/torchvision== version" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -c $(CONSTRAINTS) --index-url $(TORCH_INDEX) \
		torch==$(TORCH_PIN)+$(CUDA) torchvision==$(TORCHVISION_PIN)+$(CUDA)
	$(MAKE) setup
	$(PY) -m utils.gpu_setup --cuda $(CUDA) --constraints $(CONSTRAINTS)

# The device, a bf16 matmul and one training step of every encoder; one error line when no GPU is seen.
gpu-check: setup
	$(PY) bench/gpu_check.py --quick

# Every GPU goal of docs/BENCHMARKS.md in at most 8 minutes: OUT/gpu_check.csv and OUT/gpu_check.md.
OUT ?= results/gpu_check
gpu-bench: setup
	$(PY) bench/gpu_check.py $(OUT)

# Federated runs go JOBS at a time, one torch thread each (2 cores: 2 jobs); JOBS=1 runs them in one process.
JOBS ?= 2
demo: setup
	$(PY) run_pipeline.py experiments/demo.yaml --jobs $(JOBS) --threads 1

# The demo's question on edges, keypoints and surface normals with four algorithms, each task trained longer:
# 37 min 9 s on a 2-core Intel Xeon with AVX-512 (2026-12-05, with the positive control), 55 min 38 s on a 2-core EPYC with the code of
# 2026-11-28 (docs/BENCHMARKS.md, "The full CPU set").
paper-cpu: setup
	$(PY) run_pipeline.py experiments/paper_cpu.yaml --jobs $(JOBS) --threads 1

# When the embedding-based penalty appears: the demo's edges once per knob level, each knob moved alone toward the
# paper's setting (docs/results/mechanism.md says what it found and how long it took).
mechanism: setup
	$(PY) run_pipeline.py experiments/mechanism.yaml --jobs $(JOBS) --threads 1

# Does client-level DP amplify the embedding-based penalty? The demo's question (edges, keypoints) and the digits one,
# each once per privacy level: no DP, clipping only, ε = 50, 8, 2 (docs/results/privacy.md: what it found, how long).
privacy: setup
	$(PY) run_pipeline.py experiments/privacy.yaml --jobs $(JOBS) --threads 1
	$(PY) run_pipeline.py experiments/digits_privacy.yaml --jobs $(JOBS) --threads 1

# One pytest worker per core (pytest-xdist); tests share no temporary path, port or global state.
# The docs requirements too: tests/test_docs_site.py builds the site strictly. The 20 slowest tests are
# listed at the end; those marked slow (9 s or more) are left out by `pytest -m "not slow"`, a quick pass.
# Bytecode is cached (__pycache__, git-ignored) even where the environment sets PYTHONDONTWRITEBYTECODE: the
# suite starts about a hundred Python processes, and without the cache each compiles the project's modules again.
test: setup $(DOCS_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n auto --durations=20 tests
	$(MAKE) --no-print-directory test-kernels

# The tests marked `kernels` claim floats equal across two computations. They run again here under other CPU
# kernels: ATen's AVX2 and scalar ("default") code paths, oneDNN capped at AVX2, MKL at AVX2. A claim that holds
# under one CPU's kernels only (an AVX-512 host differs from an AVX2 one in the last bits) then fails on every
# machine, not just on some. About 30 s a pass on 2 cores.
KERNELS ?= avx2 default
test-kernels: setup
	for isa in $(KERNELS); do \
		echo "kernels: ATEN_CPU_CAPABILITY=$$isa ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"; \
		PYTHONDONTWRITEBYTECODE= ATEN_CPU_CAPABILITY=$$isa ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
			$(PY) -m pytest -q -n auto -m kernels tests || exit 1; \
	done

# The documentation site (mkdocs.yml), strictly: a broken link, a missing page or image fails it. Its
# reference pages are generated from the code at build time (docsgen/), so it builds in the project's venv.
$(DOCS_STAMP): requirements-docs.txt constraints.txt $(STAMP)
	$(call install,-r requirements-docs.txt)
	touch $(DOCS_STAMP)

docs: setup $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(call install,-r bench/requirements.txt)
	for script in bench/bench_*.py; do $(PY) $$script || exit 1; done

# Mutation testing (dev-only, not CI): mutmut over network/algorithms/ and network/aggregation.py with
# the tests named in setup.cfg's [mutmut] section; 2 workers (the development machine has 2 cores).
mutation: setup
	$(call install,-r requirements-dev.txt)
	$(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

# Real Taskonomy via omnidata-tools (needs internet). SUBSET=debug|tiny|medium|full|fullplus.
# The licence must be accepted: NAME, EMAIL and AGREE=yes are passed on (the download refuses to start without them).
SUBSET ?= tiny
NAME ?=
EMAIL ?=
AGREE ?= no
download: setup
	$(PY) download_taskonomy.py --subset $(SUBSET) --dest data/taskonomy --name "$(NAME)" --email "$(EMAIL)" \
		$(if $(filter yes,$(AGREE)),--agree_all,--no-agree_all)

# CIFAR via torchvision's downloader (needs internet): step 1 with --download, DATASET=cifar10|cifar100.
DATASET ?= cifar10
download-cifar: setup
	$(PY) extract_datapoints_for_experiments.py --family cifar --dataset $(DATASET) --data_path data/cifar --download \
		--out results/datapoints_$(DATASET)

clean:
	rm -rf results/* data/synthetic
