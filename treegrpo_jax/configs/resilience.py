"""`configs/multihop.py:tiny` at toy sizes: the run that the reliability checks kill and resume.

  python launch/train.py --config=configs/resilience.py --workdir=/tmp/toy

Three Tree-GRPO steps of a 2-layer, 32-wide model on a 24-question synthetic world, a
checkpoint after every step, the KL reference on (so the saved reference is exercised).
Kill it at any moment (SIGTERM or SIGKILL) and run the same command again: it resumes and
ends with the same parameters, bit for bit, as a run never interrupted. Used by
`benchmarks/resilience.py` and tests/train/test_kill_resume.py; `:http` switches to the
HTTP retriever (set `--config.retriever.url`).
"""

from ml_collections import ConfigDict

from treegrpo_jax.configs import multihop as _multihop


def get_config(arg: str | None = None) -> ConfigDict:
    """`arg`: "" (in-process BM25) or "http" (the retriever server at `retriever.url`)."""
    c = _multihop.get_config("tiny")
    c.model.dims = dict(embed_dim=32, mlp_dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    c.model.tokenizer_vocab = 384  # small corpus, small vocabulary
    c.data.world.update(
        seed=1,
        num_people=24,
        num_cities=8,
        num_countries=3,
        num_organisations=6,
        num_works=10,
        # 1 and 2 hops: short demonstrations (a 4-hop one is longer than the 512-token context).
        questions_per_hop=(12, 12, 0, 0),  # 24 questions, a quarter of them for evaluation
        test_fraction=0.25,
    )
    c.data.eval_prompts = 2  # greedy EM on two questions, after the cold start and at the end
    # A short, loud cold start on flawless think-free demonstrations: enough for the policy to
    # search (the retriever is then really called during the RL steps), cheap enough for a check.
    c.sft.update(steps=16, batch_rows=8, demonstrations=32)
    c.sft.optim.update(learning_rate=3e-2)  # loud on purpose: a few searches per RL step after 16 steps
    c.sft.script.update(skip_think_rate=1.0, wrong_answer_rate=0.0, misspelled_query_rate=0.0, guess_rate=0.0)
    c.agent.update(max_step_tokens=16)  # short steps: cheap rollouts
    c.rl.update(length_buckets=(256, 512), num_minibatches=1, kl_coef=0.001)  # KL on: reference saved
    c.run.update(
        steps=3,  # three RL steps
        prompts_per_step=2,
        eval_every=3,
        checkpoint_every=1,  # a checkpoint after every step: every kill point has one behind it
        keep_checkpoints=2,  # rotation runs (older steps are deleted after a newer one commits)
        render_trees=0,  # no pictures: the checks read parameters and logs
        context_len=512,  # short rows keep a CPU train step well under a second
    )
    for part in [p for p in (arg or "").split(",") if p]:
        if part == "http":
            c.retriever.update(kind="http", timeout_s=2.0, max_retries=3, max_outage_s=20.0)
        else:
            raise ValueError(f"configs/resilience.py: unknown variant {part!r} (http)")
    return c
