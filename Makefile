# Two entry points for a fresh machine: `make demo` (images from the built-in model) and
# `make test` (the test suite). Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; any torch in the package's range works (see pyproject.toml).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,ray,t2i,chameleon,serve,openvino,trt-rtx]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lantern generate --num-images 8 -o demo.png --stats-json demo.json

# The suite in TEST_WORKERS processes (pytest-xdist), each taking a whole test module at a time so
# that a module's fixtures (its exported bundles) are built once, in the order tests/conftest.py
# puts them in (the longest first); TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest $(XDIST) --durations=25

# the quick loop: leaves out the tests marked slow (ONNX exports, end-to-end CLI runs); CI runs `make test`
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff format --check lantern_rt tests
	$(VENV)/bin/ruff check lantern_rt tests

clean:
	rm -rf $(VENV) .pytest_cache
