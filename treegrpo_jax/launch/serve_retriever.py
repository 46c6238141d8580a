"""Serve BM25 over a corpus with the Search-R1 retrieval protocol (POST /retrieve).

  python launch/serve_retriever.py --corpus=corpus.jsonl --port=8000

Like Search-R1's servers it returns `topk` passages for every query (the matched ones by score,
then unmatched ones to fill; --matched_only returns only passages sharing a term with the query).
Prints "Serving N passages at http://HOST:PORT/retrieve" once listening (--port=0 picks a free
port). Point training at it with the HTTP retriever URL. Binds 127.0.0.1 unless --host says otherwise.
"""

from absl import app, flags

from treegrpo_jax.env.bm25 import BM25Config
from treegrpo_jax.env.retrieval_server import ServerConfig, serve_corpus

_CORPUS = flags.DEFINE_string("corpus", None, 'Corpus JSONL, {"id", "contents"} per line.', required=True)
_PORT = flags.DEFINE_integer("port", 8000, "TCP port; 0 picks a free one.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Bind address (0.0.0.0 exposes it to the network).")
_MAX_K = flags.DEFINE_integer("max_k", 50, "Largest topk accepted.")
_MAX_QUERIES = flags.DEFINE_integer("max_queries", 512, "Most queries per request.")
_MATCHED_ONLY = flags.DEFINE_bool(
    "matched_only", False, "Return only passages sharing a term with the query (default: always topk)."
)
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "BM25 index cache; default ~/.cache/treegrpo_jax/bm25.")


def main(argv):
    del argv
    serve_corpus(
        _CORPUS.value,
        server_cfg=ServerConfig(
            host=_HOST.value, port=_PORT.value, max_k=_MAX_K.value, max_queries=_MAX_QUERIES.value
        ),
        bm25_cfg=BM25Config(cache_dir=_CACHE_DIR.value, fill_to_k=not _MATCHED_ONLY.value),
    )


def run() -> None:
    """`treegrpo-serve-retriever` (and `python launch/serve_retriever.py`)."""
    app.run(main)
