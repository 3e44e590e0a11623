# ssdtrain developer tasks. Everything runs inside ./.venv, created on demand.
#
#   make test [PYTEST_ARGS="-k equivalence -x"] [TEST_WORKERS=2]
#                                       TEST_WORKERS pytest-xdist processes (0: in this one)
#   make demo | make bench | make clean | make distclean
#   make soak [SOAK_STEPS=500]          500 steps: nothing may grow (tests/test_soak.py)
#   make asan-test [ASAN_PYTEST_ARGS=...]   native engine under ASan+UBSan (see below)
#   make zero-infinity                  DeepSpeed's async_io op built, then the recipe's test
#   make gpu-check [GPU_PYTHON=python3] GPU acceptance on an NVIDIA GPU (see below)
#   make gpu-trace                       profiler traces of a GPU step at three quotas (below)
#   make gpu-bench                       tables A and B against checkpointing on a GPU (below)
#
# torch is installed first and only if the venv cannot import it, so a torch
# you put in .venv yourself (e.g. a CUDA build) is kept. Override the default
# with TORCH_SPEC / TORCH_PIP_ARGS, e.g.
#   make test TORCH_SPEC=torch==2.4.1 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON         ?= python3
VENV           ?= .venv
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=
EXTRAS         ?= test,bench,megatron,deepspeed,hf,lightning
PYTEST_ARGS    ?=
TEST_WORKERS   ?= 2
CXX            ?= g++

VPY   := $(VENV)/bin/python
PIP   := $(VPY) -m pip
STAMP := $(VENV)/.ssdtrain-installed

.DEFAULT_GOAL := test
.DELETE_ON_ERROR:
.PHONY: venv test demo bench soak clean distclean asan-test zero-infinity gpu-check gpu-trace \
        gpu-bench

# The native engine ssdtrain._C (csrc/) is built by the editable install below.
NATIVE_SRCS := $(wildcard csrc/*.cpp csrc/engine/*.cpp csrc/engine/*.h)

# Reinstall (and so rebuild ssdtrain._C in place) when packaging metadata or the
# native sources change.
$(STAMP): setup.py pyproject.toml $(NATIVE_SRCS)
	@if [ ! -x "$(VPY)" ]; then \
		echo "==> creating $(VENV) with $(PYTHON)"; \
		$(PYTHON) -m venv $(VENV) || exit 1; \
	fi
	@if $(VPY) -c "import torch" >/dev/null 2>&1; then \
		echo "==> keeping installed torch $$($(VPY) -c 'import torch; print(torch.__version__)' 2>/dev/null)"; \
	else \
		echo "==> installing $(TORCH_SPEC)"; \
		$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" || exit 1; \
	fi
	@echo "==> installing ssdtrain (editable) with extras [$(EXTRAS)]"
	@DS_BUILD_OPS=0 $(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $@

venv: $(STAMP)

# Tests run in TEST_WORKERS processes (pytest-xdist, --dist load --maxschedchunk 2: each
# worker takes the next two tests as it finishes, in collection order, which
# tests/conftest.py makes longest first). Most of the suite waits on the disk, sleeps or runs a child, so two
# workers on two cores take well under the time of one.
test: $(STAMP)
	$(VPY) -m pytest tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist load --maxschedchunk 2) $(PYTEST_ARGS)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

bench: $(STAMP)
	$(VPY) benchmarks/step_overhead.py

SOAK_STEPS ?= 500
soak: $(STAMP)
	SOAK_STEPS=$(SOAK_STEPS) $(VPY) -m pytest tests/test_soak.py -m slow -q -p no:cacheprovider

# zero-infinity: examples/zero_infinity_nvme.py (ZeRO-3 with parameters and optimizer
# state on NVMe, plus ssdtrain's activations) needs DeepSpeed's async_io op, which
# JIT-builds in about 7 minutes and needs libaio (apt-get install libaio-dev). Built once
# into $(ZI_EXT_DIR) (TORCH_EXTENSIONS_DIR), then tests/test_zero_infinity.py (marked
# slow; `make test` skips it while the op is not built) runs against it.
ZI_EXT_DIR ?= $(CURDIR)/build/torch_extensions
zero-infinity: $(STAMP)
	@mkdir -p $(ZI_EXT_DIR)
	TORCH_EXTENSIONS_DIR=$(ZI_EXT_DIR) DS_ACCELERATOR=cpu $(VPY) -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); assert b.is_compatible(True), 'async_io needs libaio: apt-get install libaio-dev'; b.load()"
	TORCH_EXTENSIONS_DIR=$(ZI_EXT_DIR) DS_ACCELERATOR=cpu $(VPY) -m pytest tests/test_zero_infinity.py -m slow -q -s -p no:cacheprovider

# gpu-check: GPU acceptance (tools/gpu_check.py) on a machine with an NVIDIA GPU and
# a CUDA build of torch already installed, with no network: uses $(GPU_PYTHON) as it is
# (no venv, nothing installed or downloaded), builds ssdtrain._C in place, runs the tests
# marked cuda and benchmarks/gpu_smoke.py (small and ~1B), and writes report.md and
# report.json into $$GPU_CHECK_DIR (default: a fresh temp folder, printed). Exits 2
# where no CUDA device can be used.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py

# gpu-trace: where a GPU step's time goes when 1/16, 1/8 and 1/4 of its offloadable
# bytes go to pinned RAM (tools/gpu_trace.py: a profiler trace per quota, every thread,
# and a summary of each: device gaps, copies, the launching thread's time in ssdtrain
# and in CUDA runtime calls). Same machine requirements as gpu-check; after it (it uses
# the ssdtrain._C that gpu-check built). Writes into $$GPU_TRACE_DIR.
GPU_TRACE_DIR ?= /tmp/ssdtrain-gpu_trace
gpu-trace:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) tools/gpu_trace.py --out $(GPU_TRACE_DIR) $(GPU_TRACE_ARGS)

# gpu-bench: ssdtrain against checkpointing and the peers (benchmarks/gpu_bench.py):
# table A, the ~1B GPT (none, checkpoint, selective checkpointing, save_on_cpu, the
# default, offload-all, budgets); table B, Llama-3-8B-shaped layers at 32k tokens,
# recomputed, with their inputs in GPU memory, copied synchronously, or offloaded by
# ssdtrain to RAM or the SSD. One process per table, no row started after
# GPU_BENCH_ARGS' --budget-s (default 450 s). Same machine requirements as gpu-check;
# after it. Writes docs/results/gpu_bench_<date>.{md,json} (or $$GPU_BENCH_DIR).
GPU_BENCH_DIR ?= $(CURDIR)/docs/results
gpu-bench:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_bench.py --out $(GPU_BENCH_DIR) $(GPU_BENCH_ARGS)

# asan-test: the native engine under AddressSanitizer + UndefinedBehaviorSanitizer.
#  1. csrc/tests/engine_selftest.cpp (engine only, no Python) with leak detection ON;
#  2. ssdtrain._C rebuilt in place with the sanitizers and $(ASAN_TESTS) run against it:
#     the engine's own tests, the io_timeout_s races (tests/test_timeouts.py: memory an
#     I/O request still uses must not be freed; its subprocesses inherit LD_PRELOAD, so
#     they run under ASan too), fork safety (tests/test_fork.py) and the store's I/O
#     thread (tests/test_io_thread.py). CPython is not
#     built with ASan, so libasan must be loaded first
#     (LD_PRELOAD, found with `$(CXX) -print-file-name=libasan.so`), together with
#     libstdc++ (python does not link it, and ASan's C++ exception interceptor aborts
#     with "real___cxa_throw != 0" when libstdc++ is loaded after it). Leak detection
#     is off there (the interpreter does not free everything at exit);
#  3. ssdtrain._C rebuilt normally again, whatever the result, so `make test` and the
#     editable install keep working without LD_PRELOAD.
# Needs pybind11 in the venv (installed here) because setup.py build_ext runs
# without pip's build isolation.
SANITIZE         := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
ASAN_PRELOAD      = $(shell $(CXX) -print-file-name=libasan.so) $(shell $(CXX) -print-file-name=libstdc++.so)
ASAN_PYTEST_ARGS ?= -q
ASAN_TESTS       ?= tests/test_native_engine.py tests/test_timeouts.py tests/test_fork.py \
                    tests/test_io_thread.py tests/test_polled.py
asan-test: $(STAMP)
	@mkdir -p build/asan
	$(CXX) -std=c++17 -O1 -g $(SANITIZE) -Wall -Wextra -Icsrc csrc/engine/*.cpp \
		csrc/tests/engine_selftest.cpp -o build/asan/engine_selftest -pthread
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./build/asan/engine_selftest
	@$(PIP) install -q "pybind11>=2.10"
	CFLAGS="$(SANITIZE) -g" LDFLAGS="$(SANITIZE)" $(VPY) setup.py -q build_ext --inplace \
		--force --build-temp build/asan/ext
	@status=0; \
	LD_PRELOAD="$(ASAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		$(VPY) -m pytest $(ASAN_TESTS) $(ASAN_PYTEST_ARGS) || status=$$?; \
	echo "==> rebuilding ssdtrain._C without sanitizers"; \
	$(VPY) setup.py -q build_ext --inplace --force --build-temp build/native || exit 1; \
	exit $$status

# Build outputs only; the venv and benchmark results are kept. The stamp goes
# too, because removing in-place build products (e.g. ssdtrain/_C*.so) breaks
# the editable install until it is redone.
clean:
	rm -rf build dist *.egg-info .eggs .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*.so' -o -name '*.py[co]' \) -type f -exec rm -f {} +
	rm -f $(STAMP)

distclean: clean
	rm -rf $(VENV)
