# tarshards: the two commands are `make demo` and `make test` (`make lint` checks the style).
# Set-up is quiet: pip's output goes to $(VENV)/setup.log, shown when a step fails.
# `make demo` installs what the demo needs (the runtime extras in `.[demo]`); `make test`, `lint`
# and `bench` add the rest (`.[all,dev]`: every extra and the test tools). One stamp each.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
LOG := $(VENV)/setup.log
SOURCES := pyproject.toml setup.py $(wildcard src/tarshards/_c/*.c src/tarshards/_c/*.h)
# torch pinned in every pip line: while pip backtracks over the s3fs/aiobotocore/boto3 pins it
# would otherwise try other torch releases (gigabytes of CUDA wheels)
TORCH := "torch==2.13.0"
# where torch comes from: e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only
# build (pip's default index gives the CUDA build on Linux, gigabytes)
TORCH_INDEX ?=
# run a set-up step with its output in the log; on failure show the log's end and stop
QUIET = quiet() { echo "+ $$*" >> $(LOG); "$$@" >> $(LOG) 2>&1 || { tail -n 60 $(LOG); \
	echo "set-up failed: $$* (full log: $(LOG))"; exit 1; }; }; quiet

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(DEMO_STAMP): $(SOURCES)
	@echo "setting up $(VENV) for the demo (torch, dask, scikit-learn; log: $(LOG)) ..."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@: > $(LOG)
	@$(QUIET) $(PY) -m pip install -q --upgrade pip
	@$(QUIET) $(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@$(QUIET) $(PY) -m pip install -q -e ".[demo]" $(TORCH)
	@$(PY) -c "import tarshards._speedups" 2>/dev/null || echo "note: the C accelerator did not build; using the pure Python reader"
	@$(PY) -c "import tarshards._jpeg" 2>/dev/null || echo "note: the C JPEG decoder did not build (needs libjpeg-turbo's headers: apt install libjpeg-dev); crops decode whole JPEGs"
	@$(PY) -c "import tarshards._xxh3" 2>/dev/null || echo "note: the C xxh3_64 did not build (needs libxxhash's headers: apt install libxxhash-dev); the xxhash package hashes (same values, holding the GIL)"
	@touch $@

$(STAMP): $(DEMO_STAMP) $(SOURCES)
	@echo "installing every extra and the test tools into $(VENV) (log: $(LOG)) ..."
	@$(QUIET) $(PY) -m pip install -q -e ".[all,dev]" $(TORCH)
	@touch $@

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check src tests bench examples setup.py
	$(PY) -m ruff format --check src tests bench examples setup.py
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info demo_out
