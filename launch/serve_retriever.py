"""Serve BM25 with the Search-R1 retrieval protocol.

The program is `treegrpo_jax/launch/serve_retriever.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-serve-retriever`.
"""

from treegrpo_jax.launch.serve_retriever import run

if __name__ == "__main__":
    run()
