# Two entry points: `make demo` runs the main job, `make test` runs the test suite.
# Both set up a fresh machine first (idempotent, fast when everything is present).

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
# The torchvision release paired with TORCH_VERSION, and timm: the vision-model tests use both.
TORCHVISION_VERSION ?= 0.28.0
TIMM_VERSION ?= 1.0.31
# torchao's float8 training, which Recipe(float8=...) runs (the `float8` extra); its release pairs with TORCH_VERSION.
TORCHAO_VERSION ?= 0.18.0
APT_PACKAGES := graphviz openmpi-bin libopenmpi-dev chromium slurmctld slurmd slurm-client munge iproute2

.PHONY: setup demo test test-fast lab notebooks docs docs-serve

setup:
	@# The pinned CPU build first, so that the project install does not pull a CUDA build.
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' else 1)" 2>/dev/null \
		|| $(PYTHON) -m pip install -q torch==$(TORCH_VERSION)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else echo "note: install these system packages for the full suite:$$missing"; fi; \
	fi
	@# After the system packages: mpi4py builds against the Open MPI headers where it has no wheel.
	@# Without MPI the install goes on and the MPI cluster tests skip themselves.
	@# torch is named again in the same command so no dependency can swap in a CUDA build.
	@$(PYTHON) -m pip install -q torch==$(TORCH_VERSION) torchao==$(TORCHAO_VERSION) -e ".[dev,models,vision,float8,mpi]" 2>/dev/null \
		|| $(PYTHON) -m pip install -q torch==$(TORCH_VERSION) torchao==$(TORCHAO_VERSION) -e ".[dev,models,vision,float8]"
	@# torchvision's wheel on PyPI depends on a CUDA torch build: --no-deps keeps the CPU one (its
	@# other dependencies come from the `vision` extra above; tests/models/vision.py says why its
	@# C++ detection ops may not load, which the classification models never call).
	@$(PYTHON) -m pip install -q --no-deps torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION) timm==$(TIMM_VERSION)

demo: setup
	$(PYTHON) -m nbscaler.cli demo

test: setup
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup tests


# The edit-test loop: everything that runs in one process and takes less than seconds on its own
# (docs/getting-started.md gives its size and time; `python -m benchmarks.test_suite` measures it and `make test`).
test-fast:
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup -m "not multiprocess and not cluster and not browser and not notebook and not slow" tests

lab: setup
	$(PYTHON) -m jupyter lab notebooks

# Run every walkthrough in a fresh kernel and save it with its outputs and provenance
# (`make notebooks ONLY="01 04"` for some).
notebooks: setup
	$(PYTHON) -m nbscaler.cli notebooks $(if $(ONLY),--only $(ONLY))

# The documentation site (mkdocs.yml): built strictly, so a broken link or a page left out fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

# The same site at http://127.0.0.1:8000, rebuilt as the pages change.
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve
