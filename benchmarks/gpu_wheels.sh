#!/usr/bin/env bash
# Wheels a bare CUDA image lacks for benchmarks/gpu_check.py (its Python 3.12 already has jax[cuda],
# flax, optax, orbax, transformers, torch): downloads them into .whl/ (git-ignored) for the device
# machine to install with `pip install --no-index --target`. See README "The GPU path".
#   gguf                                  every part (treegrpo_jax.model imports the GGUF reader)
#   bm25s ml-collections tensorboardX     the smollm2 part (the training loop)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf==0.19.0 bm25s==0.3.16 ml-collections==1.1.0 tensorboardX==2.6.5
ls -la .whl
