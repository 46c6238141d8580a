"""treegrpo_jax: Tree-GRPO for LLM agents in JAX/Flax (TPU, GPU, CPU)."""

import setuptools

# Compatible ranges: what the code needs (>= the versions it was seen working with, below the next
# release that may break it: the next minor for 0.x libraries, the next major otherwise). The exact
# set seen working together is constraints.txt, which `make` installs with `pip install -c`.
INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "transformers>=5.24,<6",
    "tokenizers>=0.23.3,<0.24",
    "jinja2>=3.1,<4",  # transformers' apply_chat_template (the pretrained path, launch/generate)
    "safetensors>=0.8,<1",
    "ml-collections>=1.1,<2",
    "absl-py>=2.1,<3",
    "etils>=1.7,<2",  # epath, for the TFDS builder
    "bm25s>=0.3.16,<0.4",
    "gguf>=0.19,<0.20",
    "jaxtyping>=0.3.9,<0.4",
    "numpy>=2.0,<3",
    "pyarrow>=15,<27",
    "tqdm>=4.66,<5",
    "matplotlib>=3.8,<4",
    "tensorboardX>=2.6,<3",
    "tensorflow-datasets>=4.9.10,<5",  # array_record path only; TensorFlow is never installed
    "array-record>=0.8.6,<0.9",
]

EXTRAS_REQUIRE = {
    # Reference implementations for parity tests; torch is the CPU build.
    "test": [
        "pytest>=8,<10",
        "ruff==0.14.10",
        "torch>=2.13,<3",
        "accelerate>=1.0,<2",
        "grain>=0.2.18,<0.3",
        "portpicker>=1.6,<2",
        # Run-time shape and type checks of model/, rl/ and rollout/ in the tests (with jaxtyping).
        "beartype>=0.23.1,<0.24",
    ],
    # Peers measured side by side in benchmarks/. Tunix 0.1.7 pins safetensors<0.8, which conflicts
    # with ours, so `make bench-install` adds it without its dependency pins (its sampler runs fine).
    "bench": ["torch>=2.13,<3", "accelerate>=1.0,<2"],
    # On a TPU VM: the runtime. On any host: the TPU compiler of `treegrpo-compile` (libtpu
    # 0.0.42.x for jax 0.10.2; every JAX process of that environment then probes for a TPU).
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    "cuda": ["jax[cuda12]>=0.10.2,<0.11"],
}

CONSOLE_SCRIPTS = [
    "treegrpo-train=treegrpo_jax.launch.train:run",
    "treegrpo-eval=treegrpo_jax.launch.eval:run",
    "treegrpo-generate=treegrpo_jax.launch.generate:run",
    "treegrpo-export-hf=treegrpo_jax.launch.export_hf:run",
    "treegrpo-serve-retriever=treegrpo_jax.launch.serve_retriever:run",
    "treegrpo-prepare-data=treegrpo_jax.data.tfds_builder:main",
    "treegrpo-compile=treegrpo_jax.launch.compile:run",
]

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
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
