"""Plain batched generation on the engine (the `launch/generate.py` demo and tests)."""

from __future__ import annotations

import sys
import time

import jax

from treegrpo_jax.env.prompt import prompt_ids
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams


def generate_ids(
    model: Decoder,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids=(),
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[list[int]]:
    """Continues every prompt (token ids); returns the new ids of each (EOS included if hit)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_ids: every prompt needs at least one token")
    max_len = max(len(p) for p in prompts) + max_new_tokens + 1
    engine = Engine(model, num_slots=len(prompts), max_len=max_len, eos_ids=eos_ids)
    engine.append({i: p for i, p in enumerate(prompts)})
    sampling = SamplingParams.make(len(prompts), temperature=temperature, top_p=top_p, top_k=top_k)
    keys = jax.random.split(jax.random.key(seed), len(prompts))
    out = engine.decode(
        list(range(len(prompts))), max_new_tokens=max_new_tokens, sampling=sampling, keys=keys
    )
    return [out.tokens[i, : out.num_tokens[i]].tolist() for i in range(len(prompts))]


def generate_text(model: Decoder, tokenizer, prompts: list[str], *, chat: bool = True, **kwargs) -> list[str]:
    """Text in, text out. With `chat`, each prompt is wrapped in the tokenizer's chat template."""
    ids = [prompt_ids(prompt, tokenizer, chat=chat) for prompt in prompts]
    new = generate_ids(model, ids, eos_ids=tuple(tokenizer.eos_ids), **kwargs)
    eos = set(tokenizer.eos_ids)
    return [tokenizer.decode([t for t in seq if t not in eos]) for seq in new]


def generate_main(
    *, model: str, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int, chat: bool
) -> str:
    """`launch/generate.py`: loads `model`, prints one completion (and the timing to stderr)."""
    from treegrpo_jax.model.pretrained import load_pretrained

    t0 = time.perf_counter()
    decoder, cfg, tokenizer = load_pretrained(model)
    t1 = time.perf_counter()
    (text,) = generate_text(
        decoder,
        tokenizer,
        [prompt],
        chat=chat,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    t2 = time.perf_counter()
    print(text)
    print(
        f"[{cfg.num_params / 1e6:.0f}M params; load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s with compile]",
        file=sys.stderr,
    )
    return text
