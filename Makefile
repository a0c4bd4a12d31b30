# The two commands: `make demo` and `make test`. Each creates .venv and installs
# everything it needs from the pinned constraints; nothing is installed by hand.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch fbgemm-gpu-cpu
	$(PIP) install -q -c constraints.txt -e ".[cpu,dev,bench]"
	@# Last and without its dependencies: torchrec's metadata asks for the CUDA fbgemm-gpu (we
	@# run on fbgemm-gpu-cpu), and a later install would print pip's resolver ERROR about it.
	$(PIP) install -q --no-deps -c constraints.txt torchrec
	$(PY) -c "import torchrec, fbgemm_gpu, recscale"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recscale train configs/demo.yaml --out runs/demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy
	@# Two workers, one thread each (no oversubscription on a 2-core machine); a file's tests run on one
	@# worker, so its module-scoped fixtures (one launch trains many runs) are built once.
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile

# For local work: no type check, no multi-process or slow tests.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -m "not dist and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff format --check src tests bench

clean:
	rm -rf $(VENV) runs .mypy_cache
