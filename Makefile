# transformer_fp8: two commands.
#   make demo   installs whatever is missing, then runs examples/quickstart.py
#   make test   installs whatever is missing, then runs the whole test suite
# torch is installed (pinned below) only when it is not importable: an existing torch, such as
# a user's own CUDA build, is used as it is and never reinstalled or upgraded.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_PIN := torch==2.11.0
# Test and example tools (the `test` extra of pyproject.toml, plus transformers, pinned, for the
# HuggingFace model tests; tensorboard for the debug statistics' TensorBoard test).
TRANSFORMERS_VERSION := 5.23.0
TOOLS := setuptools wheel ninja pytest numpy matplotlib tqdm tensorboard transformers==$(TRANSFORMERS_VERSION)
# Debian/Ubuntu mark their system Python as externally managed; let pip install there.
export PIP_BREAK_SYSTEM_PACKAGES ?= 1
SOURCES := setup.py pyproject.toml $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh')

.PHONY: demo test install deps clean

demo: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest tests -q

deps:
	@command -v c++ >/dev/null || { echo "A C++ compiler is needed: apt-get install g++ (or build-essential)"; exit 1; }
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_PIN)"
	@$(PYTHON) -c "import setuptools, wheel, ninja, pytest, numpy, matplotlib, tqdm, tensorboard, transformers; assert transformers.__version__ == '$(TRANSFORMERS_VERSION)'" 2>/dev/null || $(PIP) install $(TOOLS)

# The build flags (README) in effect: a change of them rebuilds too.
BUILD_FLAGS := archs=$(TRANSFORMER_FP8_CUDA_ARCHS) force_cuda=$(TRANSFORMER_FP8_FORCE_CUDA)$(if \
	$(TRANSFORMER_FP8_CPU_ONLY), cpu_only=$(TRANSFORMER_FP8_CPU_ONLY))

# (Re)build the extension when a source or a build flag changed, or it does not import.
install: deps
	@if [ ! -f .build-stamp ] || [ "$$(cat .build-stamp)" != "$(BUILD_FLAGS)" ] || \
	    [ -n "$$(find $(SOURCES) -newer .build-stamp)" ] || \
	    ! $(PYTHON) -c "import transformer_fp8._C" 2>/dev/null; then \
	  $(PIP) install --no-build-isolation --no-deps -e . && echo "$(BUILD_FLAGS)" > .build-stamp; \
	else echo "transformer_fp8 is built and up to date"; fi
	@$(PYTHON) -c "import transformer_fp8 as t; print('transformer_fp8 build:', t.build_info())"

clean:
	rm -rf build *.egg-info transformer_fp8/*.so .build-stamp
