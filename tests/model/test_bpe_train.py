"""The offline BPE tokenizer: byte-exact round trips, atomic tags, determinism, the saved directory."""

import json

import pytest
from transformers import PreTrainedTokenizerFast

from treegrpo_jax.data import WorldConfig, build_world
from treegrpo_jax.model.bpe_train import AGENT_TAGS, SPECIAL_TOKENS, train_bpe_tokenizer
from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.rollout.stops import token_bytes

VOCAB = 1024
AWKWARD = [
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\r\nnewlines\n\n\n",
    "café naïve Ærøskøbing — “quotes” 1,234.5 ½",
    "日本語のテキスト, 한국어, العربية, עברית",
    "emoji 🙂🏳️‍🌈 and combining e\u0301",
    "\x00\x01 control \x7f",
    "<think> why </think>\n<search> The Rivers of Brura </search>",
    "\n\n<information>Doc 1 (Title: X) y</information>\n\n<answer> 1891 </answer>",
    "< search > <Search> </search > <searc <think><think></think>",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def world():
    return build_world(WorldConfig())


@pytest.fixture(scope="module")
def texts(world):
    # Tags inside the training text must not matter (they are cut out before BPE sees it).
    return [*world.passages, *(f"<think> {r.question} </think>" for r in world.train)]


@pytest.fixture(scope="module")
def saved(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    return train_bpe_tokenizer(texts, vocab_size=VOCAB, out_dir=out), out


def test_round_trip_world_text_unicode_and_tags(world, saved):
    tok, _ = saved
    for text in [*world.passages[:50], *(r.question for r in world.test[:50]), *AWKWARD]:
        assert tok.decode(tok.encode(text)) == text


def test_tags_and_specials_are_single_tokens(saved):
    tok, _ = saved
    assert [tok.encode(s) for s in SPECIAL_TOKENS] == [[0], [1], [2]]
    tag_ids = [tok.encode(t) for t in AGENT_TAGS]
    assert all(len(ids) == 1 for ids in tag_ids)
    assert len({ids[0] for ids in tag_ids}) == len(AGENT_TAGS)
    step = "<think> ok </think>\n<search> Kelo </search>"
    ids = tok.encode(step)
    assert ids[0] == tag_ids[0][0] and ids[-1] == tag_ids[3][0]
    # Tags are text the parser reads: skipping special tokens keeps them, drops the ChatML ones.
    assert tok.decode(ids, skip_special_tokens=True) == step
    assert tok.decode(tok.encode("<|im_start|>a<|im_end|>"), skip_special_tokens=True) == "a"
    # The stop-string matcher sees a tag's exact bytes.
    assert token_bytes(tok)[tag_ids[3][0]] == b"</search>"


def test_vocabulary_compresses_world_text(world, saved):
    tok, _ = saved
    assert tok.vocab_size <= VOCAB
    chars = sum(len(p) for p in world.passages)
    assert sum(len(tok.encode(p)) for p in world.passages) < chars / 3


def test_deterministic(texts, saved, tmp_path):
    _, out = saved
    again = tmp_path / "again"
    train_bpe_tokenizer(texts, vocab_size=VOCAB, out_dir=again)
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    other = tmp_path / "other"
    train_bpe_tokenizer(texts[::-1][:200], vocab_size=VOCAB, out_dir=other)
    assert (other / "tokenizer.json").read_bytes() != (out / "tokenizer.json").read_bytes()


def test_saved_directory_loads_the_same_tokenizer(saved):
    tok, out = saved
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = Tokenizer.from_hf_dir(out)
    plain = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    for text in AWKWARD:
        assert loaded.encode(text) == tok.encode(text) == plain.encode(text, add_special_tokens=False)
    assert loaded.eos_ids == tok.eos_ids == (0, 2)
    assert loaded.pad_id == tok.pad_id == 0
    assert loaded.bos_id is None and not loaded.add_bos
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    messages = [{"role": "user", "content": "Question: who?"}]
    expected = "<|im_start|>user\nQuestion: who?<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages) == expected


def test_without_out_dir_writes_nothing(texts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = train_bpe_tokenizer(texts[:100], vocab_size=400)
    assert list(tmp_path.iterdir()) == []
    assert tok.decode(tok.encode(AWKWARD[6])) == AWKWARD[6]


@pytest.mark.parametrize("vocab_size", [0, 256 + 3 + 8, True, 1000.0])
def test_rejects_a_vocabulary_without_room_for_merges(vocab_size):
    # A float is refused by the function's own check (ValueError) or, first, by the suite's
    # run-time type check of its `int` annotation (TypeError): either names the argument.
    with pytest.raises((ValueError, TypeError), match="vocab_size"):
        train_bpe_tokenizer(["abc"], vocab_size=vocab_size)


@pytest.mark.parametrize("tags", [("<a>", "<a>"), (" ",), ("<|endoftext|>",)])
def test_rejects_bad_tags(tags):
    with pytest.raises(ValueError, match="tags"):
        train_bpe_tokenizer(["abc"], vocab_size=600, tags=tags)


def test_rejects_non_text():
    with pytest.raises(TypeError, match="str"):
        train_bpe_tokenizer(["abc", b"bytes"], vocab_size=600)
