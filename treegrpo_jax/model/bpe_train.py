"""Train a small byte-level BPE tokenizer offline (the embedded default's vocabulary).

The `:tiny` setup has no pretrained vocabulary: `train_bpe_tokenizer` learns one from the synthetic
world's text in about a second and returns our `Tokenizer`, optionally saved as an HF tokenizer
directory that `Tokenizer.from_hf_dir` (and `transformers.AutoTokenizer`) load.

Choices, and why:

* **Byte-level** (GPT-2 style): the 256 byte symbols are always in the vocabulary, so *any* text
  round-trips (`decode(encode(s)) == s`), unicode included; nothing maps to an unknown token.
* **Special tokens** `<|endoftext|>` (EOS and padding), `<|im_start|>`, `<|im_end|>` take ids 0-2;
  the chat template is ChatML without a default system message (a tiny model should not spend
  context on boilerplate). `<|im_end|>` counts as an extra end-of-turn id.
* **Agent tags are atomic, not special.** `<think>`, `</think>`, `<search>`, `</search>`,
  `<answer>`, `</answer>`, `<information>`, `</information>` are added as ordinary added tokens:
  each is one id wherever it appears, `decode(..., skip_special_tokens=True)` keeps them (they are
  part of the text the parser and the reward read), and the stop-string matcher sees their exact
  bytes. Tag-like text that is not exactly one of them (`< search >`, `<Search>`) still encodes,
  byte by byte. Because added tokens are cut out of the text before BPE runs, the trainer is fed the
  pieces *between* tags and special tokens, exactly as encoding will see them, so no merges are
  wasted on tag fragments.
* **Deterministic:** the same texts in the same order give the same vocabulary, merges and ids
  (the trainer breaks count ties by the pair itself).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from treegrpo_jax.model.tokenizer import Tokenizer

__all__ = ["AGENT_TAGS", "CHATML_TEMPLATE", "EOS_TOKEN", "SPECIAL_TOKENS", "train_bpe_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# The tags of env/prompt.py's template and env/observation.py's wrapper.
AGENT_TAGS = (
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
)
# ChatML, as Qwen2.5-Instruct, minus the default system message and the tool-calling branches.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A pair seen once is an accident of the corpus, not a unit worth an embedding row.
_MIN_FREQUENCY = 2


def _pieces(texts: Iterable[str], atomic: Sequence[str]) -> Iterator[str]:
    """Yields the parts of each text between atomic tokens (which BPE never sees at encode time)."""
    # Longest first, so a token that is a prefix of another can never win the alternation.
    splitter = re.compile("|".join(re.escape(t) for t in sorted(atomic, key=len, reverse=True)))
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"train_bpe_tokenizer: texts must be str, got {type(text).__name__}")
        yield from (piece for piece in splitter.split(text) if piece)


def _train_raw(texts: Iterable[str], *, vocab_size: int, tags: Sequence[str]) -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be invented at the start of every segment
    # (prompt, step, observation), and decode(encode(s)) would no longer equal s.
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tags),  # The tags are added after training; the total stays within.
        min_frequency=_MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, seen in the corpus or not: this is what makes every text encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_pieces(texts, (*SPECIAL_TOKENS, *tags)), trainer=trainer)
    raw.add_tokens([AddedToken(t, normalized=False, special=False) for t in tags])
    return raw


def train_bpe_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    out_dir: str | os.PathLike[str] | None = None,
    tags: Sequence[str] = AGENT_TAGS,
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with ChatML special tokens and atomic agent tags.

    Args:
      texts: training text (the world's passages, prompts, demonstrations...), consumed once; the
        result depends on the texts and their order only.
      vocab_size: the most ids the tokenizer may have, specials and tags included. A small corpus
        can run out of merges first (then the vocabulary is smaller: read `Tokenizer.vocab_size`).
      out_dir: when set, the tokenizer is saved there as an HF directory (`tokenizer.json`,
        `tokenizer_config.json`, the chat template, and `generation_config.json` holding the EOS ids
        so `Tokenizer.from_hf_dir` restores them); created if missing, files of those names replaced.
      tags: added as atomic, non-special tokens (default: our agent tags).

    Returns:
      The tokenizer. EOS and padding are `<|endoftext|>`; `eos_ids` also holds `<|im_end|>`.

    Raises:
      ValueError: if `vocab_size` leaves no room for merges, or a tag is blank or repeated.
    """
    tags = tuple(tags)
    if len(set(tags)) != len(tags) or any(not t.strip() or t in SPECIAL_TOKENS for t in tags):
        raise ValueError(f"train_bpe_tokenizer: tags must be distinct, non-blank, non-special: {tags}")
    floor = 256 + len(SPECIAL_TOKENS) + len(tags)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= floor:
        raise ValueError(
            f"train_bpe_tokenizer: vocab_size must be an int > {floor} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens + {len(tags)} tags), got {vocab_size!r}"
        )
    raw = _train_raw(texts, vocab_size=vocab_size, tags=tags)
    backend = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHATML_TEMPLATE,
        # Cleanup would turn " ." into "." on decode and break the byte-exact round trip.
        clean_up_tokenization_spaces=False,
    )
    eos_ids = [raw.token_to_id(EOS_TOKEN), raw.token_to_id("<|im_end|>")]
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        backend.save_pretrained(str(out))
        # Where `Tokenizer.from_hf_dir` (and HF generation) read the end-of-turn ids from.
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2) + "\n")
    return Tokenizer(backend, eos_ids=eos_ids)
