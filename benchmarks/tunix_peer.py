"""Peer row for the budget sweep: the same chain GRPO run through Tunix' agentic GRPO learner (issue 9).

    python benchmarks/tunix_peer.py --cold_start=DIR --out=DIR [--steps=10] [--prompts_per_step=4]
        [--group=4] [--seed=0] [--eval_prompts=320]

`DIR` is the sweep's shared cold start (`OUT/cold_start` of `benchmarks/budget_sweep.py`: Orbax
`checkpoints/0`, `model_config.json`, `tokenizer/`, `world/`). Its weights are copied into a Tunix
`Qwen2` model, trained with `tunix.rl.agentic.agentic_grpo_learner.GRPOLearner` (our prompt, `<search>`
/ `<answer>` actions, BM25 top-1 observations, forced final answer, training reward), copied back into
our `Decoder` and evaluated with OUR greedy evaluator on the same test questions as the sweep, so EM
is measured identically. Writes `OUT/result.json` (em, em_by_hops, train wall_s, reward curve, the
deviations from our loop) and prints a small table next to the cold start's EM.

Legend: L layers, E embed, F mlp, H query heads, K kv heads, D head dim, V vocab.

Why Qwen2 and not Llama3: Tunix 0.1.7's Llama3 attention calls `apply_rope` without the config's
theta (always 1e6, tunix/models/llama3/model.py:352-361), while the `:tiny` model uses theta 1e4.
Qwen2 passes `rope_theta` through and supports tied embeddings; its q/k/v biases are kept at zero
and frozen, so it computes exactly our function (checked at start: max |Δlogit|).

What Tunix' learner does not do, and how this file supplies it through Tunix' extension points
(a `BaseRollout` class for `ClusterConfig.rollout_engine`, an agent, an environment, a chat parser):
  * per-call sampling seeds: the vanilla sampler seeds every call with PRNGKey(0) when the rollout
    config's seed is None (tunix/generate/sampler.py:835-836), and the agentic learner samples each
    of the G group members by its own batch-1 call, so all G would be identical;
  * stop strings and a per-step token cap: the sampler only stops at EOS ids, and the learner passes
    the whole remaining episode budget as each call's `max_generation_steps`
    (tunix/rl/agentic/trajectory/trajectory_collect_engine.py:499-503);
  * our continuation format (one assistant turn: prompt, then step, observation, step, ...): the
    learner renders messages with a chat parser, which here writes the first user message in the
    tokenizer's chat template and every later message verbatim;
  * the sweep's advantage and loss: chain_4 uses our `tree` estimator (group z-score plus the
    one-leaf-tree term r / (1 + 1e-6)), registered here as a Tunix advantage estimator, and our dual
    clip (3.0), which Tunix' loss reads as `algo_config.epsilon_c` (tunix/rl/algo_core.py:376) but
    its GRPOConfig does not declare. What still differs is listed in `DEVIATIONS` (and result.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "configs"), os.path.join(ROOT, "benchmarks")]  # this checkout

import _peers  # noqa: E402

_HOPS = (1, 2, 3, 4)
_STOPS = ("</search>", "</answer>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """The peer run; everything not here comes from `configs/multihop.py:tiny`, as in the sweep.

    Attributes:
      cold_start: the sweep's cold-start workdir (checkpoint 0 is the starting policy).
      out: where result.json goes.
      steps / prompts_per_step / group / seed: the sweep's chain_4 run (M = 4 chains per prompt).
      eval_prompts: test questions for the final greedy evaluation (0 = all).
      max_prompt_tokens: the first prompt is left-padded to this many tokens (Tunix' layout).
      max_response_tokens: an episode's completion (steps and observations) is padded/cut to this.
      max_concurrency: episodes in flight at once (Tunix' orchestrator).
    """

    cold_start: str
    out: str
    steps: int = 10
    prompts_per_step: int = 4
    group: int = 4
    seed: int = 0
    eval_prompts: int = 320
    max_prompt_tokens: int = 64
    max_response_tokens: int = 768
    max_concurrency: int = 8

    def __post_init__(self):
        if self.group < 2:
            raise ValueError(
                f"PeerConfig.group must be ≥ 2 (Tunix' GRPOConfig.num_generations), got {self.group}"
            )
        for name in (
            "steps",
            "prompts_per_step",
            "max_prompt_tokens",
            "max_response_tokens",
            "max_concurrency",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"PeerConfig.{name} must be ≥ 1, got {getattr(self, name)}")


# ------------------------------------------------------------------------- weights
def tunix_qwen2(model, cfg):
    """A Tunix `Qwen2` of the same shape holding our weights; its q/k/v biases stay zero.

    Layouts already match: ours "e h d" / "e k d" / "h d e" / "e f" / "f e" are Tunix' DNH / DKH /
    NHD Einsum kernels and `nnx.Linear` kernels.
    """
    from flax import nnx
    from tunix.models.qwen2 import model as qwen2

    from treegrpo_jax.model.config import RopeType

    if cfg.qkv_bias:
        raise ValueError("this peer maps bias-free Llama configs (qkv_bias=False)")
    if cfg.rope_scaling.rope_type != RopeType.DEFAULT:
        raise ValueError(f"Tunix Qwen2 has no RoPE scaling; got {cfg.rope_scaling.rope_type}")
    tcfg = qwen2.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.embed_dim,
        hidden_dim=cfg.mlp_dim,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,  # a float works: only `theta ** fraction` uses it
        norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_embeddings,
    )
    tm = qwen2.Qwen2(tcfg, rngs=nnx.Rngs(0))
    for ours, theirs in _peers.tunix_weight_pairs(model, tm, cfg):
        theirs.set_value(ours[...])
    return tm


def back_to_decoder(tm, model, cfg) -> None:
    """Copies a (trained) Tunix Qwen2's weights into our `Decoder` in place."""
    import jax.numpy as jnp
    import numpy as np

    for layer in tm.layers:  # frozen at zero: anything else means ours cannot hold the model
        for b in (layer.attn.q_bias, layer.attn.k_bias, layer.attn.v_bias):
            if np.any(np.asarray(b[...]) != 0):
                raise RuntimeError("a Tunix q/k/v bias moved away from zero; the freeze did not hold")
    stacked: dict[int, list] = {}
    for ours, theirs in _peers.tunix_weight_pairs(model, tm, cfg):
        if isinstance(ours, _peers.LayerRow):  # layers come in order
            stacked.setdefault(id(ours.stacked), [ours.stacked, []])[1].append(theirs[...])
        else:
            ours.set_value(jnp.asarray(theirs[...]))
    for var, rows in stacked.values():
        var.set_value(jnp.stack(rows))


def max_logit_diff(model, tm, tokens) -> float:
    """max |our logits − Tunix' logits| over a [B, T] batch of real (non-pad) tokens."""
    import jax.numpy as jnp
    import numpy as np

    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ours = model(tokens, positions, causal)
    theirs, _ = tm(tokens, positions, None, causal)
    return float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))


# ------------------------------------------------------------- the Tunix pieces
def _rollout_class():
    """Tunix' vanilla sampler with a fresh seed per call, stop strings and a per-step cap."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    class StepRollout(vanilla_rollout.VanillaRollout):
        """One agent step per call, as our engine decodes it (see the module docstring for why)."""

        def __init__(self, rollout_actor, tokenizer, mesh, rollout_config, *, step_tokens, seed, cache_size):
            from flax import nnx

            del mesh
            # A copy of the arrays, not only of the module: the learner decides whether to sync
            # the rollout weights by array identity (tunix/rl/utils.py:91-99, agentic_rl_learner.py
            # :202-207), and `nnx.clone` shares the arrays, so the copy would never be synced and
            # every step would sample from the cold start. Synced once per global step, the
            # rollouts of a step all come from the policy at its start, as in our loop.
            cfg = rollout_actor.config
            graphdef, state = nnx.split(rollout_actor)
            super().__init__(
                nnx.merge(graphdef, jax.tree.map(jnp.copy, state)),
                tokenizer,
                base_rollout.CacheConfig(
                    cache_size=cache_size,
                    num_layers=cfg.num_layers,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                ),
            )
            self._step_tokens = step_tokens
            self._root = jax.random.PRNGKey(seed)
            self._calls = itertools.count()
            self._lock = threading.Lock()

        def generate(self, prompts, rollout_config, **kwargs):
            with self._lock:  # one draw per call; concurrent callers get distinct keys
                key = jax.random.fold_in(self._root, next(self._calls))
            budget = min(self._step_tokens, rollout_config.max_tokens_to_generate)
            out = super().generate(
                prompts,
                dataclasses.replace(rollout_config, max_tokens_to_generate=budget, seed=key),
                **kwargs,
            )
            tokenizer = self._sampler.tokenizer
            cut = [_stop_at(np.asarray(t), tokenizer) for t in out.tokens]
            return base_rollout.RolloutOutput(
                text=[tokenizer.decode(list(map(int, t[:n]))) for t, n in zip(out.tokens, cut, strict=True)],
                logits=None,
                tokens=[np.asarray(t)[:n] for t, n in zip(out.tokens, cut, strict=True)],
                left_padded_prompt_tokens=out.left_padded_prompt_tokens,
                logprobs=None
                if out.logprobs is None
                else [np.asarray(lp)[:n] for lp, n in zip(out.logprobs, cut, strict=True)],
            )

    return StepRollout


def _stop_at(tokens, tokenizer) -> int:
    """Tokens kept: up to the one that completes the first stop string (all when none does)."""
    text = ""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode([int(t) for t in tokens[:n]])
        if any(s in text for s in _STOPS):
            return n
    return len(tokens)


class ContinuationParser:
    """Tunix chat parser for one continuing assistant turn (our prompt layout).

    The first message (the question, a user message) is written in the tokenizer's chat template
    with the assistant header; every later message (a model step, an observation) verbatim, so the
    sampler sees "prompt, step, observation, step, ..." exactly as our engine lays it out.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer  # ours (treegrpo_jax.model.tokenizer.Tokenizer)

    def parse(self, messages, add_generation_prompt: bool = False, is_first_msg: bool = False, **_) -> str:
        messages = [m for m in messages if m.get("role") != "system" or m.get("content")]
        if not messages:
            return ""
        if is_first_msg and self._tokenizer.has_chat_template:  # as rollout/tree_search.py `prompt_tokens`
            head = self._tokenizer.apply_chat_template(
                [{"role": "user", "content": messages[0]["content"]}], add_generation_prompt=True
            )
            return head + "".join(m["content"] for m in messages[1:])
        return "".join(m["content"] for m in messages)


def _agent_and_env_classes():
    from tunix.rl.agentic.agents import agent_types, base_agent
    from tunix.rl.agentic.environments import base_environment

    from treegrpo_jax.env.actions import Answer, Search, parse_action
    from treegrpo_jax.env.observation import format_observation
    from treegrpo_jax.env.rewards import evaluation_reward, score_trajectory

    class SearchAgent(base_agent.ConversationAgentBase):
        """Keeps the conversation; the action is the step's raw text (the environment parses it)."""

        def _init_messages(self, system_prompt: str) -> None:
            del system_prompt  # our prompt has no system message
            self._messages = []

        def update_from_model(self, response: str, **kwargs) -> agent_types.Action:
            self._messages.append({"role": "assistant", "content": response})
            self._trajectory.steps.append(agent_types.Step(model_response=response))
            return agent_types.Action(action=response)

    class SearchEnv(base_environment.BaseTaskEnv):
        """Our agent loop's rules for one chain: searches, invalid steps, the forced answer, the reward."""

        def __init__(self, task, *, agent, env, episodes, **kwargs):
            super().__init__(task, max_steps=agent.max_turns + 1, **kwargs)
            self._agent, self._env, self._episodes = agent, env, episodes
            self._golds = json.loads(_item(task["golds"]))
            self._steps: list[str] = []
            self._calls = self._turns = 0

        def _initial_observation(self):
            return {"prompts": _item(self.task["prompts"])}

        def _forced_next(self) -> bool:  # rollout/agent.py `forced_next`
            return self._calls >= self._agent.max_tool_calls or self._turns >= self._agent.max_turns

        def _step_impl(self, action):
            text = action.action if hasattr(action, "action") else str(action)
            forced = self._forced_next()
            self._steps.append(text)
            self._turns += 1
            parsed = parse_action(text, search_allowed=not forced)
            if isinstance(parsed, Answer) or forced:
                # The training reward of our leaves (format-aware table) and, for the log, pure EM.
                reward = score_trajectory(self._steps, self._golds).reward
                em = evaluation_reward(self._steps, self._golds)
                self._episodes.append(
                    {
                        "group": self.extra_kwargs.get("group_id"),
                        "prompt": _item(self.task["prompts"]),
                        "steps": list(self._steps),
                        "tool_calls": self._calls,
                        "reward": reward,
                        "em": em,
                    }
                )
                return base_environment.EnvStepResult(None, reward, True, {"em": em})
            if isinstance(parsed, Search):
                self._calls += 1
                (result,) = self._env.retriever.search([parsed.query], self._agent.top_k)
                obs = format_observation(result, tokenizer=self._env.tokenizer, cfg=self._env.observation)
            else:
                obs = self._env.prompt.invalid_action
            if self._forced_next():
                obs += self._env.prompt.forced_answer
            return base_environment.EnvStepResult(obs, 0.0, False, {})

    return SearchAgent, SearchEnv


def _item(x):
    """A field of Tunix' one-example micro-batch (a length-1 array) as a Python value."""
    import numpy as np

    return np.asarray(x).reshape(-1)[0].item() if not isinstance(x, str) else x


# ------------------------------------------------------------------------ the run
def _sweep_config(pc: PeerConfig):
    """The sweep's chain_4 TrainConfig (`budget_sweep._config`), for the agent, texts and optimizer."""
    import budget_sweep

    sc = budget_sweep.SweepConfig(
        out=pc.out,
        seeds=1,
        steps=pc.steps,
        prompts_per_step=pc.prompts_per_step,
        eval_prompts=pc.eval_prompts,
    )
    variant = f"tree_m={pc.group},tree_n=0,tree_l=0"  # RUNS["chain_4"] at group 4
    return budget_sweep._config(variant, sc, seed=pc.seed, steps=pc.steps)


def load_cold_start(workdir: str):
    """(Decoder, ModelConfig, Tokenizer, step-0 metrics) of the cold start's checkpoint 0."""
    from treegrpo_jax.train.export import load_model_config, load_tokenizer, restore_model

    model_cfg = load_model_config(workdir)
    tokenizer = load_tokenizer(workdir)
    model, _ = restore_model(workdir, model_cfg, step=0)  # one device, as `launch/eval.py` restores it
    step0 = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["step"] == 0 and "eval/em" in row:
                step0 = row
    return model, model_cfg, tokenizer, step0


def _data(workdir: str, cfg):
    """Train / test rows and the BM25 retriever of the cold start's world, as our setup builds them."""
    from treegrpo_jax.data.readers import read_rows
    from treegrpo_jax.env.bm25 import BM25Retriever

    world = os.path.join(workdir, "world")
    train = read_rows([os.path.join(world, "train.jsonl")]).rows
    test = read_rows([os.path.join(world, "test.jsonl")]).rows
    with open(os.path.join(world, "corpus.jsonl")) as f:
        passages = [json.loads(line)["contents"] for line in f]
    return train, test[: cfg.data.eval_prompts or None], BM25Retriever.from_texts(passages)


def _batches(train_rows, cfg, env, steps: int):
    """The sweep's prompts, step by step (same loader, seed and batch size), as Tunix input dicts."""
    from treegrpo_jax.data.loader import LoaderConfig, RowLoader

    loader = RowLoader(
        train_rows,
        LoaderConfig(batch_size=cfg.run.prompts_per_step, seed=cfg.run.seed),
        process_index=0,
        process_count=1,
    )
    for _ in range(steps):
        rows = next(loader)
        yield {
            "prompts": [env.prompt.render(r.question) for r in rows],
            "golds": [json.dumps(list(r.golden_answers)) for r in rows],
        }


def _optimizer(cfg, steps_per_update: int):
    """Our AdamW exactly (clip → Adam → decay on matrices, −lr(RL step)); q/k/v biases frozen."""
    import optax

    from treegrpo_jax.rl.optim import learning_rate

    o = cfg.optim
    train = optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip else optax.identity(),
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        # Ours decays every weight with an "embed" axis: the matrices, not the norms (1-D here).
        optax.add_decayed_weights(o.weight_decay, mask=lambda p: _tree_map(lambda x: x.ndim >= 2, p)),
        # Our schedule is per RL step; Tunix counts optimizer updates (mini-batches).
        optax.scale_by_schedule(lambda n: -learning_rate(o, n // steps_per_update)),
    )

    def labels(params):
        # Any key on the path: at init the leaves may be nnx Variables (paths end in their value).
        return _tree_map_path(
            lambda path, _: "frozen" if any(k.endswith("_bias") for k in path) else "train", params
        )

    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels)


def _tree_map(fn, tree):
    import jax

    return jax.tree.map(fn, tree)


def _tree_map_path(fn, tree):
    import jax

    def name(k):
        return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

    return jax.tree_util.tree_map_with_path(lambda p, x: fn(tuple(name(k) for k in p), x), tree)


def run(pc: PeerConfig) -> dict:
    """Converts, trains with Tunix, converts back, evaluates with ours; writes OUT/result.json."""
    import jax
    import numpy as np
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.agentic import agentic_grpo_learner
    from tunix.rl.rollout import base_rollout

    from treegrpo_jax.train import setup
    from treegrpo_jax.train.evaluate import evaluate, format_table

    os.makedirs(pc.out, exist_ok=True)
    cfg = _sweep_config(pc)
    loss = cfg.loss
    if loss.kl_coef:  # would need a reference model in the cluster; the sweep's :tiny has none
        raise ValueError(f"this peer runs without a KL reference; config has kl_coef={loss.kl_coef}")
    if loss.entropy_coef:
        raise ValueError("Tunix' GRPO loss has no entropy bonus; the sweep's :tiny uses entropy_coef=0")
    model, model_cfg, tokenizer, step0 = load_cold_start(pc.cold_start)
    train_rows, test_rows, retriever = _data(pc.cold_start, cfg)
    env = setup.make_env(cfg, tokenizer, retriever)
    agent = cfg.agent

    tm = tunix_qwen2(model, model_cfg)
    ids = [tokenizer.encode(env.prompt.render(r.question)) for r in test_rows[:4]]
    probe = np.asarray([row[: min(map(len, ids))] for row in ids])
    parity = max_logit_diff(model, tm, probe)
    print(f"Tunix Qwen2 vs our Decoder on {probe.size} tokens: max |Δlogit| = {parity:.2e}")
    if parity > 1e-3:
        raise RuntimeError(f"the converted model is not ours (max |Δlogit| {parity:.3g})")

    # One device, automatic axes (Tunix' models shard by logical names; explicit axes reject its gathers).
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    minibatches = cfg.layout.num_minibatches
    mini = pc.prompts_per_step // minibatches  # prompts per optimizer update, as our num_minibatches
    context = pc.max_prompt_tokens + pc.max_response_tokens
    cache = 1 << (context - 1).bit_length()  # the sampler pads prompts to powers of two
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=pc.max_response_tokens,
        max_prompt_length=pc.max_prompt_tokens,
        kv_cache_size=cache + agent.max_step_tokens,
        temperature=agent.temperature,
        top_p=agent.top_p,
        top_k=None,
        eos_tokens=list(tokenizer.eos_ids),
        return_logprobs=True,
    )
    engine = functools.partial(
        _rollout_class(),
        step_tokens=agent.max_step_tokens,
        seed=pc.seed,
        cache_size=rollout_cfg.kv_cache_size,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=tm,
        tokenizer=tokenizer.backend,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine=engine,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=_optimizer(cfg, minibatches),
                max_steps=pc.steps,
                mini_batch_size=mini,
                train_micro_batch_size=mini,
                eval_every_n_steps=10**9,
                data_sharding_axis=("fsdp",),
                pbar_description="Tunix GRPO",
            ),
            rollout_config=rollout_cfg,
        ),
    )
    algo = _grpo_config_class()(
        num_generations=pc.group,
        num_iterations=1,
        beta=loss.kl_coef,
        epsilon=loss.eps_low,
        epsilon_high=loss.eps_high,
        epsilon_c=loss.dual_clip,
        loss_agg_mode=str(loss.aggregation),  # "token-mean" in both
        advantage_estimator=_register_estimator(str(loss.estimator)),
        max_response_length=pc.max_response_tokens,
        max_concurrency=pc.max_concurrency,
    )
    agent_cls, env_cls = _agent_and_env_classes()
    episodes: list[dict] = []  # every finished training episode (list.append is thread-safe)
    learner = agentic_grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=algo,
        chat_parser=ContinuationParser(tokenizer),
        agent_class=agent_cls,
        env_class=env_cls,
        env_kwargs={"agent": agent, "env": env, "episodes": episodes},
    )
    step_ends = _time_steps(cluster)
    t0 = time.perf_counter()
    learner.train(_batches(train_rows, cfg, env, pc.steps))
    wall = time.perf_counter() - t0
    step_s = np.diff([t0, *step_ends]).tolist()
    if len(step_ends) != cluster.global_steps:
        raise RuntimeError(f"rollout weights synced {len(step_ends)} times in {cluster.global_steps} steps")

    back_to_decoder(cluster.actor_trainer.model, model, model_cfg)
    slots = min(len(test_rows), 256)
    metrics, _ = evaluate(
        setup.make_engine(model, tokenizer, num_slots=slots, max_len=cfg.run.context_len),
        env,
        test_rows,
        agent,
        seed=cfg.run.seed,
    )
    result = {
        "system": "tunix agentic GRPOLearner",
        "tunix_version": _version("google-tunix"),
        "steps": cluster.global_steps,
        "rollout_weight_syncs": len(step_ends),  # must equal steps: rollouts follow the policy
        "optimizer_updates": int(cluster.actor_trainer.train_steps),
        "prompts_per_step": pc.prompts_per_step,
        "group": pc.group,
        "seed": pc.seed,
        "em": metrics["eval/em"],
        "em_by_hops": {str(h): metrics.get(f"eval/em/synthetic_{h}hop") for h in _HOPS},
        "em_cold_start": step0.get("eval/em"),
        "em_cold_start_by_hops": {str(h): step0.get(f"eval/em/synthetic_{h}hop") for h in _HOPS},
        "tool_calls_per_question": metrics["eval/tool_calls_mean"],
        "reward_curve": _curve(episodes, "reward", pc.prompts_per_step),
        "train_em_curve": _curve(episodes, "em", pc.prompts_per_step),
        "tool_calls_curve": _curve(episodes, "tool_calls", pc.prompts_per_step),
        "wall_s": wall,  # learner.train: rollouts, updates, weight syncs and every compile
        "step_s": step_s,  # per global step; the first one holds most compiles
        "median_step_s_after_first": float(np.median(step_s[1:])) if len(step_s) > 1 else None,
        "eval_questions": len(test_rows),
        "parity_max_abs_logit_diff": parity,
        "deviations": DEVIATIONS,
    }
    with open(os.path.join(pc.out, "result.json.tmp"), "w") as f:
        json.dump(result, f, indent=2)
    os.replace(os.path.join(pc.out, "result.json.tmp"), os.path.join(pc.out, "result.json"))
    with open(os.path.join(pc.out, "episodes.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in sorted(episodes, key=lambda e: e["group"]))
    print(format_table(metrics))
    print(_table(result))
    return result


def _grpo_config_class():
    """Tunix' GRPOConfig plus the dual-clip bound its loss reads with `getattr(algo_config, "epsilon_c")`
    (tunix/rl/algo_core.py:376), which the config class does not declare."""
    from tunix.rl.agentic import agentic_grpo_learner

    @dataclasses.dataclass(kw_only=True)
    class PeerGRPOConfig(agentic_grpo_learner.GRPOConfig):
        epsilon_c: float | None = None

    return PeerGRPOConfig


def _register_estimator(estimator: str) -> str:
    """The Tunix advantage estimator that computes ours for chains; returns its registered name.

    Chains are trees of one leaf, so our `tree` estimator (intra + inter, rl/advantages.py) is the
    group z-score plus the singleton term r / (1 + 1e-6); `grpo` / `inter` are the z-score alone,
    which is Tunix' own "grpo" (same unbiased std and 1e-6).
    """
    import numpy as np
    from tunix.rl import function_registry

    from treegrpo_jax.rl.advantages import EPS

    if estimator in ("grpo", "inter"):
        return "grpo"
    if estimator not in ("tree", "intra"):
        raise ValueError(f"unknown estimator {estimator!r}")
    name = f"treegrpo_chain_{estimator}"
    try:
        function_registry.get_advantage_estimator(name)
        return name
    except (KeyError, ValueError, LookupError):
        pass

    def chain_advantages(rewards, num_generations: int):
        r = np.asarray(rewards, np.float64)
        singleton = r / (1.0 + EPS)
        if estimator == "intra":
            return singleton
        g = r.reshape(-1, num_generations)
        z = (g - g.mean(-1, keepdims=True)) / (g.std(-1, ddof=1, keepdims=True) + EPS)
        return z.reshape(-1) + singleton

    function_registry.register_advantage_estimator(name)(chain_advantages)
    return name


def _time_steps(cluster) -> list[float]:
    """Timestamps of the ends of global steps: the learner syncs the rollout weights once per step
    (agentic_rl_learner.py:1022-1034), so wrapping that call times each step without changing it."""
    ends: list[float] = []
    sync = cluster.sync_weights

    def timed_sync():
        sync()
        ends.append(time.perf_counter())

    cluster.sync_weights = timed_sync
    return ends


def _curve(episodes: list[dict], key: str, prompts_per_step: int) -> list[float]:
    """Per-step means of an episode field (Tunix numbers groups step by step: step = id // prompts)."""
    import numpy as np

    by_step: dict[int, list[float]] = {}
    for e in episodes:
        by_step.setdefault(e["group"] // prompts_per_step, []).append(e[key])
    return [float(np.mean(by_step[s])) for s in sorted(by_step)]


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _table(r: dict) -> str:
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}"

    hops = " | ".join(f"{h}-hop" for h in _HOPS)
    lines = [
        f"| policy | EM | {hops} | train wall (s) |",
        "|---|---|" + "---|" * len(_HOPS) + "---|",
        f"| cold start | {pct(r['em_cold_start'])} | "
        + " | ".join(pct(r["em_cold_start_by_hops"][str(h)]) for h in _HOPS)
        + " | – |",
        f"| Tunix GRPO, {r['steps']} steps × {r['prompts_per_step']} × {r['group']} | {pct(r['em'])} | "
        + " | ".join(pct(r["em_by_hops"][str(h)]) for h in _HOPS)
        + f" | {r['wall_s']:.0f} |",
    ]
    return "\n".join(lines)


# What differs from our chain GRPO, by construction of Tunix' learner (recorded in result.json).
DEVIATIONS = [
    "loss on temperature-scaled log-probs: the learner sets algo_config.temperature from the rollout "
    "config (tunix/rl/agentic/agentic_grpo_learner.py:233-235) and the loss divides the logits by it "
    "(tunix/rl/common.py:379-380); ours trains log pi at temperature 1 (rollouts at 0.7 in both)",
    "old log-probs are the sampler's, taken while decoding (use_rollout_logps=True, "
    "agentic_grpo_learner.py:439-441; temperature 0.7, policy at the start of the step); ours "
    "recomputes them with the trainer (mini-batch 0: the current params, so ratio 1 exactly)",
    "the sampler gets the conversation as text and re-tokenizes it at every step "
    "(agentic_rl_learner.py:438-461, rl_cluster.py:890-903, sampler.py:807); ours keeps the "
    "sampled ids and appends each observation's ids, so a BPE merge across a step/observation "
    "boundary can differ between what was sampled from and what is trained on",
    "training rows: the first prompt left-padded to max_prompt_tokens, the episode right-padded to "
    "max_response_tokens (agentic_grpo_learner.py:371-405); ours packs unpadded rows into length buckets "
    "(same loss value, different cost)",
    "an episode stopped by the response budget (max_response_tokens) ends without an environment "
    "reward (trajectory_collect_engine.py:473-484, reward 0); ours scores a truncated leaf like any "
    "other (none is expected here: the longest episode is ~560 of 768 tokens)",
    "rollouts are batch-1 sampler calls, one per episode step, up to max_concurrency episodes at once "
    "(trajectory_collect_engine.py:506-521); keys are drawn per call in arrival order, so episodes "
    "differ from ours and a rerun is not bit-identical",
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cold_start", required=True)
    p.add_argument("--out", required=True)
    for f in dataclasses.fields(PeerConfig):
        if f.name not in ("cold_start", "out"):
            p.add_argument(f"--{f.name}", type=int, default=f.default)
    logging.basicConfig(level=logging.WARNING)
    try:
        run(PeerConfig(**vars(p.parse_args(argv))))
    except BaseException:
        # Tunix' learner leaves non-daemon executor threads behind when a step fails, and the
        # interpreter would wait on them forever: report and leave.
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
