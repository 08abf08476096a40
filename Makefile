# Set up and run the course. `make test` and `make lab` install first, once.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Rewritten whenever pyproject.toml (or the torch choice) changes, so a second
# `make install` with nothing changed does nothing.
STAMP  := $(VENV)/.installed

.PHONY: venv install workshop-deps lab dist test slurm-up slurm-down clean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

# torch first, from a local CPU wheel when pip's find-links holds one, so the
# package's own `torch>=2.6` is already met and pip never fetches a CUDA build.
$(STAMP): pyproject.toml scripts/torch-requirement | $(PY)
	torch=$$($(PY) scripts/torch-requirement) && $(PY) -m pip install "$$torch"
	$(PY) -m pip install -e '.[dev]'
	touch $@

# `gpucourse workshop`: JupyterHub comes with the install (the `workshop` extra, part of `dev`),
# its proxy from npm into the venv. A second run does nothing.
workshop-deps: install
	@scripts/install-proxy $(VENV)

# The browser, workshop and SLURM tests need Chromium, the hub's proxy and SLURM: installed here when
# this is root on Debian, otherwise the scripts say how and those tests are skipped outside CI.
test: install
	-@scripts/install-chromium
	-@scripts/install-proxy $(VENV)
	-@scripts/install-slurm
	$(PY) -m pytest

# A SLURM cluster on this machine (a controller, nodes n1 and n2) to try `gpucourse submit` on; `slurm-up`
# prints the `export SLURM_CONF=...` that points SLURM's commands at it. The tests start their own.
slurm-up: install
	@scripts/install-slurm
	@$(PY) tests/slurm_cluster.py up

slurm-down:
	@$(PY) tests/slurm_cluster.py down

# 127.0.0.1 only; Jupyter makes up a token and prints the URL that carries it.
lab: install
	$(VENV)/bin/gpucourse lab

# The course as one wheel for Colab, Kaggle or a JupyterHub it did not set up (README, "Colab / Kaggle").
dist: install
	$(PY) scripts/build-wheel dist

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
