# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv if needed and install torch==2.13.0 FIRST (any other spec
# pulls several GB of CUDA wheels on these machines), then fstier with extras.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fstier-installed

.PHONY: demo test reliability bench lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,metrics,examples]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fstier demo

# pytest exit 5 means "no tests collected": treat it as a failure.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

reliability: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/reliability

bench: $(STAMP)
	$(BIN)/fstier bench

lint: $(STAMP)
	$(BIN)/ruff check fstier tests benchmarks examples
	$(BIN)/mypy fstier

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
