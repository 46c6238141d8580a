"""Tree-GRPO on single-hop QA (NQ train), the paper's second setting.

Same as configs/multihop.py but trained on NQ: the paper reports small gains there (tree@4 50.0 vs
chain@16 51.2 EM), as one search usually suffices.

  python launch/train.py --config=configs/singlehop.py --workdir=/tmp/run_nq \
    --config.model.path=/ckpt/Qwen2.5-3B-Instruct \
    --config.data.train_files=nq_train.parquet \
    --config.data.test_files=nq.parquet,triviaqa.parquet,popqa.parquet \
    --config.retriever.url=http://127.0.0.1:8000/retrieve

Variants are those of configs/multihop.py (`tiny`, `chain`, `tree_m=`, ...); `:tiny` keeps only
1-hop questions of the synthetic world.
"""

from treegrpo_jax.configs import multihop as _multihop


def get_config(arg: str | None = None):
    c = _multihop.get_config(arg)
    if c.data.kind == "synthetic":  # the tiny variant: single-hop questions only
        c.data.world.questions_per_hop = (1600, 0, 0, 0)
        c.agent.update(max_tool_calls=2, max_turns=3)
    return c
