# Two commands on a fresh machine:
#   make demo   create .venv, install, train the debug recipe (2 local ranks on CPU)
#   make test   install test needs (incl. a local SLURM cluster) and run the whole suite
#
# CPU machines install torch==2.13.0 from requirements-cpu.txt. On a GPU machine keep your
# CUDA torch:  make demo TORCH_REQUIREMENTS=
VENV ?= .venv
PYTHON ?= python3
TORCH_REQUIREMENTS ?= requirements-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# DeepSpeed JIT-compiled ops and torch.compile caches stay inside the work tree.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: demo test install clean system-deps

install: $(STAMP)

$(STAMP): pyproject.toml $(TORCH_REQUIREMENTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_REQUIREMENTS),$(PY) -m pip install --quiet -r $(TORCH_REQUIREMENTS))
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/train +recipe=debug

test: $(STAMP) system-deps
	$(PY) -m pytest -q -ra

# Debian packages the tests use: libaio for DeepSpeed's NVMe offload (the SLURM packages are
# installed by slurm/dev-cluster.sh up, which the SLURM tests call).
system-deps:
	@dpkg -s libaio-dev >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; }

clean:
	rm -rf outputs multirun .pytest_cache
