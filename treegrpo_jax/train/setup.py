"""Builds a run's parts from a TrainConfig: data, tokenizer, model, retriever, engine.

Everything derived (the synthetic world, the trained tokenizer) is written under the
workdir the first time and read back on resume, so a resumed run sees the same ids.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from treegrpo_jax.data.readers import read_rows
from treegrpo_jax.data.rows import QARow
from treegrpo_jax.data.synthetic_world import World, build_world, write_world
from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig
from treegrpo_jax.env.prompt import PromptConfig
from treegrpo_jax.env.retrieval import Retriever
from treegrpo_jax.env.reward_fn import make_reward
from treegrpo_jax.env.scripted_agent import CharTokenizer, ScriptConfig, make_demonstrations
from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.model.pretrained import load_pretrained
from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.rollout.agent import AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.page_pool import KVCacheConfig
from treegrpo_jax.rollout.stops import make_stop_table, token_bytes
from treegrpo_jax.train.config import DataKind, ModelSource, RetrieverKind, TrainConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Data:
    train: Sequence[QARow]  # a tuple, or a random-access `QARowSource` (data.kind=tfds)
    test: Sequence[QARow]
    world: World | None
    corpus_path: str


def load_data(cfg: TrainConfig, workdir: str) -> Data:
    if cfg.data.kind == DataKind.SYNTHETIC:
        world_dir = os.path.join(workdir, "world")
        world = (
            write_world(cfg.data.world, world_dir)
            if not os.path.exists(world_dir)
            else build_world(cfg.data.world)
        )
        return Data(tuple(world.train), tuple(world.test), world, os.path.join(world_dir, "corpus.jsonl"))
    if cfg.data.kind == DataKind.TFDS:
        from treegrpo_jax.data.tfds_builder import open_prepared  # TFDS only when asked for

        train, test = open_prepared(
            cfg.data.name, cfg.data.data_dir, (cfg.data.train_split, cfg.data.test_split)
        )
        log.info("TFDS %s: %d train / %d test rows (random access)", cfg.data.name, len(train), len(test))
        return Data(train, test, None, cfg.retriever.corpus)
    train = read_rows(list(cfg.data.train_files), skip_bad_rows=cfg.data.skip_bad_rows)
    test = read_rows(list(cfg.data.test_files), skip_bad_rows=cfg.data.skip_bad_rows)
    for name, res in (("train", train), ("test", test)):
        if res.num_skipped:
            log.warning("skipped %d bad %s rows, e.g. %s", res.num_skipped, name, res.bad_rows[0])
    return Data(train.rows, test.rows, None, cfg.retriever.corpus)


def make_retriever(cfg: TrainConfig, data: Data) -> Retriever:
    if cfg.retriever.kind == RetrieverKind.HTTP:
        return HttpRetriever(
            HttpRetrieverConfig(
                url=cfg.retriever.url,
                timeout_s=cfg.retriever.timeout_s,
                max_retries=cfg.retriever.max_retries,
                max_outage_s=cfg.retriever.max_outage_s or None,  # 0: error observations forever
            )
        )
    t0 = time.perf_counter()
    if data.world is not None:
        log.info("BM25: indexing the world's %d passages", len(data.world.passages))
        bm25 = BM25Retriever.from_texts([r["contents"] for r in data.world.corpus_rows()])
    elif not data.corpus_path:
        raise ValueError(
            "config.retriever.corpus is empty: set it to a corpus JSONL for BM25, or use kind=http"
        )
    else:
        log.info("BM25: loading or indexing %s (minutes the first time for a large corpus)", data.corpus_path)
        bm25 = BM25Retriever.from_corpus(data.corpus_path)
    log.info(
        "BM25: %d passages %s in %.1f s",
        bm25.num_docs,
        "loaded from the cache" if bm25.loaded_from_cache else "indexed",
        time.perf_counter() - t0,
    )
    return bm25


def demonstration_sources(
    cfg: TrainConfig, data: Data, retriever: Retriever
) -> list[tuple[tuple[QARow, ...], Retriever]]:
    """(rows, retriever) pairs the cold start demonstrates on: the train rows with the run's
    retriever, then one pair per `sft.world_variants` copy of the synthetic world (same names, facts
    re-drawn) with BM25 over its own passages. A copy's question whose text is a test question of
    the run is left out (it would be the same words with another answer)."""
    sources = [(data.train, retriever)]  # as it is: a TFDS source is read by index, never copied
    if not cfg.sft.world_variants:
        return sources
    held_out = {r.question for r in data.test}
    for k in range(1, cfg.sft.world_variants + 1):
        world = build_world(dataclasses.replace(cfg.data.world, facts_variant=k))
        rows = tuple(
            dataclasses.replace(r, id=f"variant{k}_{r.id}")
            for r in (*world.train, *world.test)
            if r.question not in held_out
        )
        bm25 = BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()])
        sources.append((rows, bm25))
    log.info(
        "cold start: demonstrations from the world and %d counterfactual copies of it (%s rows)",
        cfg.sft.world_variants,
        " + ".join(str(len(rows)) for rows, _ in sources),
    )
    return sources


def describe_retriever(retriever: Retriever) -> str:
    """One phrase for the run header."""
    if isinstance(retriever, HttpRetriever):
        return f"HTTP {retriever.cfg.url}"
    if isinstance(retriever, BM25Retriever):
        return f"BM25 over {retriever.num_docs} passages"
    return type(retriever).__name__


def make_tokenizer(cfg: TrainConfig, data: Data, retriever: Retriever, workdir: str) -> Tokenizer:
    """SCRATCH models get a BPE trained on the world's passages and draft demonstrations."""
    out = os.path.join(workdir, "tokenizer")
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return Tokenizer.from_hf_dir(out)
    if data.world is None:
        raise ValueError(
            "config.model.source=scratch needs data.kind=synthetic (a corpus to train the BPE on)"
        )
    prompt = PromptConfig.from_template(cfg.template)
    drafts = make_demonstrations(
        list(data.train[:400]),
        retriever=retriever,
        tokenizer=CharTokenizer(),
        cfg=ScriptConfig(),
        prompt=prompt,
    )
    texts = (
        list(data.world.passages)
        + [d.transcript() for d in drafts]
        + [prompt.render(r.question) for r in data.train]
    )
    # Trained into a scratch directory and renamed: a kill mid-write never leaves a tokenizer
    # directory that loads with different ids (or without its EOS ids) on resume.
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = train_bpe_tokenizer(texts, vocab_size=cfg.model.tokenizer_vocab, out_dir=tmp)
    _replace_dir(tmp, out)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, workdir: str) -> None:
    """Writes `WORKDIR/tokenizer` once, atomically (a restart finds it complete or absent)."""
    out = os.path.join(workdir, "tokenizer")
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return  # written by make_tokenizer or an earlier run: the ids must not change under a resume
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.backend.save_pretrained(tmp)
    _replace_dir(tmp, out)


def _replace_dir(tmp: str, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)  # a directory an older, non-atomic writer left half done
    os.replace(tmp, out)


def retriever_faults(retriever: Retriever) -> dict[str, int]:
    """The HTTP client's cumulative fault counters (empty for in-process retrievers)."""
    return retriever.stats.as_dict() if isinstance(retriever, HttpRetriever) else {}


def cpu_bf16_flags() -> list[str]:
    """The CPU's bf16 dot instructions (`avx512_bf16`, `amx_bf16`) from /proc/cpuinfo; [] when
    it has none, or off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16")})


def compute_dtype_for_backend(dtype: str) -> str:
    """`auto` → float32 on CPU, bfloat16 on GPU / TPU (their matmul units). A bf16 request on
    CPU is honoured, with a warning that says what it costs on this CPU (BENCHMARKS.md §7,
    `benchmarks/smollm2_step.py`)."""
    backend = jax.default_backend()
    if dtype == "auto":
        return "float32" if backend == "cpu" else "bfloat16"
    if dtype == "bfloat16" and backend == "cpu":
        flags = cpu_bf16_flags()
        if flags:
            log.warning(
                "config.model.dtype=bfloat16 on CPU: this CPU has %s, so bf16 dots run natively "
                "(measured for SmolLM2 on a 2-core EPYC with avx512_bf16: decode 1.03x, log-prob pass "
                "0.84x, update 1.19x the f32 time), "
                "and log-probs round to bf16 precision; model.dtype=auto uses float32 on CPU",
                "/".join(flags),
            )
        else:
            log.warning(
                "config.model.dtype=bfloat16 on a CPU without bf16 dot instructions (avx512_bf16 / "
                "amx_bf16): XLA:CPU converts around every dot, and a model step can be >10x slower "
                "than in float32 (SmolLM2's decode step was once measured at 2,323 ms vs 181 ms); "
                "use model.dtype=auto (float32 on CPU, bfloat16 on GPU/TPU)"
            )
    return dtype


def make_model(
    cfg: TrainConfig, tokenizer: Tokenizer | None, mesh: Mesh | None
) -> tuple[Decoder, ModelConfig, Tokenizer]:
    dtype = compute_dtype_for_backend(cfg.model.dtype)
    if cfg.model.source == ModelSource.PRETRAINED:
        model, model_cfg, tokenizer = load_pretrained(
            cfg.model.path, mesh=mesh, param_dtype=cfg.model.param_dtype, dtype=dtype
        )
        # Remat is how training runs, not what the checkpoint holds: set it on the loaded model.
        model_cfg = dataclasses.replace(
            model_cfg, remat=cfg.model.remat, attention_chunk=cfg.model.attention_chunk
        )
        model.cfg = model_cfg
        return model, model_cfg, tokenizer
    assert tokenizer is not None
    model_cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        **dict(cfg.model.dims),
        dtype=dtype,
        param_dtype=cfg.model.param_dtype,
        eos_token_ids=tokenizer.eos_ids,
        max_position_embeddings=cfg.run.context_len,
        remat=cfg.model.remat,
        attention_chunk=cfg.model.attention_chunk,
    )
    return init_model(model_cfg, seed=cfg.run.seed, mesh=mesh), model_cfg, tokenizer


def make_env(cfg: TrainConfig, tokenizer: Tokenizer, retriever: Retriever) -> AgentEnv:
    return AgentEnv(
        tokenizer=tokenizer,
        retriever=retriever,
        prompt=PromptConfig.from_template(cfg.template),
        observation=cfg.observation,
        reward=make_reward(cfg.reward),
    )


def kv_dtype_for_backend(kv_dtype: str) -> str:
    """`auto` → float32 on CPU, bfloat16 on GPU / TPU (BENCHMARKS.md §4: on CPU bf16 K/V saves
    13-20% of a `:tiny` step at 768 live tokens and ≤ 3% for SmolLM2, whose weights dominate, for a
    log-prob change of up to 0.1; on accelerators decode reads K/V at HBM bandwidth, and bf16
    halves both bytes and memory)."""
    if kv_dtype != "auto":
        return kv_dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def make_engine(
    model: Decoder,
    tokenizer: Tokenizer,
    *,
    num_slots: int,
    max_len: int,
    kv_dtype: str = "auto",
    kernels: str = "auto",
    kv_cache: KVCacheConfig | None = None,
) -> Engine:
    kv_cache = kv_cache or KVCacheConfig()
    table = make_stop_table(token_bytes(tokenizer), STOP_SEQUENCES, vocab_size=model.cfg.vocab_size)
    return Engine(
        model,
        num_slots=num_slots,
        max_len=max_len,
        eos_ids=tokenizer.eos_ids,
        stop_table=table,
        min_rows=8,
        kv_dtype=kv_dtype_for_backend(kv_dtype),
        kernels=kernels,
        kv_layout=kv_cache.layout,
        page_size=kv_cache.page_size,
        num_pages=kv_cache.pages or None,
    )


def enable_compile_cache(directory: str) -> None:
    """`run.compile_cache_dir`: JAX's persistent compilation cache there, for every program that
    took ≥ 1 s to compile (JAX's default threshold), so a restarted or repeated run skips those
    compiles. Process-wide and kept for the process's life, like JAX's own flag."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    log.info("persistent compilation cache: %s", os.path.abspath(directory))
