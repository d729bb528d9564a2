# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv if needed and install torch==2.13.0 FIRST (any other spec
# pulls several GB of CUDA wheels on these machines), then fstier.
# `make demo` (and `make bench`) install only what the demo runs: fstier and
# its runtime dependencies (numpy, xxhash, pydantic, PyYAML, aiofiles, rich,
# click). `make test`, `make reliability` and `make lint` add the extras
# dev, metrics and examples (pytest, hypothesis, ruff, mypy,
# prometheus-client, transformers).
# `make test` also installs vLLM's CPU-importable offloading modules (their
# pure-Python imports from requirements-vllm.txt, then vLLM itself with
# --no-deps; never triton or nvidia-*) so the FstierTier tests run against
# vLLM's real classes; `make demo` does not.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fstier-installed
DEV_STAMP := $(VENV)/.fstier-dev-installed
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_NODEPS := vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11

.PHONY: demo test reliability bench bench-vllm lint install install-vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,metrics,examples]'
	touch $(DEV_STAMP)

install: $(DEV_STAMP)

install-vllm: $(DEV_STAMP) $(VLLM_STAMP)

# vLLM's imports first, then vLLM itself with --no-deps: its metadata pins a
# CUDA torch and GPU packages that this install leaves out on purpose.
$(VLLM_STAMP): requirements-vllm.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r requirements-vllm.txt
	$(BIN)/python -m pip install --quiet --no-deps $(VLLM_NODEPS)
	$(BIN)/python -c "import vllm.v1.kv_offload.tiering.manager"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/fstier demo

# pytest exit 5 means "no tests collected": treat it as a failure.
# FSTIER_REQUIRE_VLLM=1: a vLLM that fails to import fails the vLLM tests
# instead of skipping them.
test: $(DEV_STAMP) $(VLLM_STAMP)
	FSTIER_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

reliability: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m slow tests/reliability

bench: $(STAMP)
	$(BIN)/fstier bench

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/bench_vllm_tier.py

lint: $(DEV_STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check fstier tests benchmarks examples
	$(BIN)/mypy fstier

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
