# Two commands set everything up (README): `make demo` runs the main job, `make test` the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch to install first; this workplace's machines carry a CPU build of 2.13.0. On a GPU
# machine pass your CUDA build, e.g. `make test TORCH_SPEC='torch>=2.6'`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-gpu bench env clean

$(BIN)/tigon: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[hf,dev]"
	@touch $@

# Main job. Until `tigon sft` lands it benchmarks the norm kernels on the machine at hand.
demo: $(BIN)/tigon
	$(BIN)/tigon env
	$(BIN)/tigon bench --ops rms_norm add_rms_norm layer_norm --out demo-out

# The whole suite on CPU: the real Triton kernels run in Triton's interpreter.
test: $(BIN)/tigon
	TRITON_INTERPRET=1 TIGON_STRICT=1 $(BIN)/python -m pytest -q -n 2 -m "not gpu" $(PYTEST_ARGS)

# On a CUDA machine: the gpu-marked tests (bf16, large shapes) with compiled kernels.
test-gpu: $(BIN)/tigon
	TIGON_STRICT=1 $(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

env: $(BIN)/tigon
	$(BIN)/tigon env

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache
