"""`rollout.py --parts=kv_dtype`: bf16-stored K/V against f32, teacher-forced over the paths of
real (2,2,1) rollouts, for the policy and SmolLM2."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _policy import SHAPES, load_policy

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.engine import Engine


def _teacher_forced(model: Decoder, tokens, lens, cache):
    return model.append(tokens, lens, cache, all_logits=True)


def run_kv_dtype(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """|Δ log-prob| of bf16-stored K/V against f32 over real rollouts' token paths.

    A (2,2,1) rollout of `--tree_prompts` prompts with the policy (see `_policy.py`) and
    SmolLM2 on the same world, f32 K/V; then every root-to-leaf path is teacher-forced through
    a fresh cache of each dtype (the XLA append path: chunks write their K/V, then attend
    them back from the cache) and the log-probs of its model-generated tokens are compared.
    """
    del model, cfg
    from treegrpo_jax.model import assets
    from treegrpo_jax.model.cache import init_cache
    from treegrpo_jax.model.pretrained import load_pretrained
    from treegrpo_jax.rollout.tree_search import rollout

    pol = load_policy(bc, bc.tree_prompts)
    env, agent, rows = pol.env, pol.agent, pol.rows
    out = {}
    policies = {"tiny_policy": (pol.model, pol.tokenizer, env, pol.stop_table)}
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
        trees, _ = rollout(engine, penv, rows, SHAPES["tree"], agent, key=jax.random.key(bc.seed))
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


def print_kv_dtype(result: dict) -> None:
    if "kv_dtype" not in result:
        return
    print("\nbf16 vs f32 stored K/V, teacher-forced over rollout paths (model-generated tokens)")
    for name, r in result["kv_dtype"].items():
        print(f"  {name}: {r['generated_tokens']} tokens of {r['paths']} paths: max |Δ log-prob| "
              f"{r['max_abs_delta_logprob']:.2e}, p99 {r['p99_abs_delta_logprob']:.2e}, "
              f"mean {r['mean_abs_delta_logprob']:.2e}")  # fmt: skip
