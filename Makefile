# Two commands on a fresh machine:
#   make demo   create .venv, install, train the debug recipe (2 local ranks on CPU)
#   make test   install test needs (lm-eval, a local SLURM cluster) and run the whole suite
#
# CPU machines install torch==2.13.0 from requirements-cpu.txt. On a GPU machine keep your
# CUDA torch:  make demo TORCH_REQUIREMENTS=
VENV ?= .venv
PYTHON ?= python3
TORCH_REQUIREMENTS ?= requirements-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-eval

# DeepSpeed JIT-compiled ops and torch.compile caches stay inside the work tree.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: demo test install clean system-deps

install: $(STAMP)

$(STAMP): pyproject.toml $(TORCH_REQUIREMENTS) | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_REQUIREMENTS),$(PY) -m pip install --quiet torch -c $(TORCH_REQUIREMENTS))
	$(PY) -m pip install --quiet -e '.[test]' $(if $(TORCH_REQUIREMENTS),-c $(TORCH_REQUIREMENTS))
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/train +recipe=debug

# The suite also needs the optional extra launcher[eval] (lm-eval, ~2-3 minutes to install once).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,eval]' $(if $(TORCH_REQUIREMENTS),-c $(TORCH_REQUIREMENTS))
	touch $(TEST_STAMP)

# Two pytest workers: while one waits (SLURM jobs, restart and watchdog timeouts, DeepSpeed's op
# build) the other trains. Each test module runs whole on one worker; tests/conftest.py orders
# the modules and keeps the SLURM ones together. Tests that signal or kill a run mid-way hold it
# at a known step (LAUNCHER_DEBUG_HOLD) instead of racing the doubled load. TEST_WORKERS=1: one process.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -ra --durations=20 $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

# Debian packages: venv support, a C++ compiler and Python headers (DeepSpeed's JIT-built ops,
# torch.compile), libaio (DeepSpeed's NVMe offload). Installed only when missing (needs root
# then). The SLURM packages are installed by slurm/dev-cluster.sh up, which the SLURM tests call.
SYSTEM_PACKAGES := python3-venv python3-dev g++ libaio-dev
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing system packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "warning: missing system packages: $$missing (install them as root: apt-get install $$missing)"; \
	  fi; \
	fi

clean:
	rm -rf outputs multirun .pytest_cache
