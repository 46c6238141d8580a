"""treegrpo_jax: Tree-GRPO for LLM agents in JAX/Flax (TPU, GPU, CPU)."""

import setuptools

# Versions pinned to the set seen working together (see README "Pinned versions").
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "ml-collections==1.1.0",
    "bm25s==0.3.16",
    "gguf==0.19.0",
    "jaxtyping==0.3.9",
    "numpy>=2.0,<3",
    "pyarrow>=15",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboardX>=2.6",
    "absl-py>=2.1",
    "tensorflow-datasets==4.9.10",  # array_record path only; TensorFlow is never installed
    "grain==0.2.18",
    "array-record==0.8.6",
]

EXTRAS_REQUIRE = {
    # Reference implementations for parity tests; torch is the CPU build.
    "test": ["pytest>=8", "ruff==0.14.10", "torch==2.13.0", "accelerate>=1.0"],
    # Peers measured side by side in benchmarks/. Tunix 0.1.7 pins safetensors<0.8, which conflicts
    # with ours, so `make bench-install` adds it without its dependency pins (its sampler runs fine).
    "bench": ["torch==2.13.0", "accelerate>=1.0"],
    "tpu": ["jax[tpu]==0.10.2"],
    "cuda": ["jax[cuda12]==0.10.2"],
}

setuptools.setup(
    name="treegrpo_jax",
    version="0.1.0",
    description="Tree-GRPO: tree-search rollouts and tree-relative advantages for LLM agents, in JAX/Flax.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["treegrpo_jax", "treegrpo_jax.*"]),
    # The CPU kernels' sources are compiled on the target machine (treegrpo_jax/native/build.py).
    package_data={"treegrpo_jax": ["env/templates/*.txt", "native/*.cc", "native/*.h"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
