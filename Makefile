# tarshards: the two commands are `make demo` and `make test` (`make lint` checks the style).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py src/tarshards/_speedups.c src/tarshards/_jpeg.c src/tarshards/_xxh3.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "torch==2.13.0"
	# torch pinned here too: while pip backtracks over the s3fs/aiobotocore/boto3 pins it would
	# otherwise try other torch releases (gigabytes of CUDA wheels)
	$(PY) -m pip install -e ".[all,dev]" "torch==2.13.0"
	$(PY) -c "import tarshards._speedups" || echo "note: the C accelerator did not build; using the pure Python reader"
	$(PY) -c "import tarshards._jpeg" || echo "note: the C JPEG decoder did not build (needs libjpeg-turbo's headers: apt install libjpeg-dev); crops decode whole JPEGs"
	$(PY) -c "import tarshards._xxh3" || echo "note: the C xxh3_64 did not build (needs libxxhash's headers: apt install libxxhash-dev); the xxhash package hashes (same values, holding the GIL)"
	touch $(STAMP)

demo: $(STAMP)
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
