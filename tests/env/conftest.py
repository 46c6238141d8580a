"""Shared fixtures: a real byte-level BPE tokenizer trained in-test, and a tiny corpus file."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_TEXTS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Berlin is the capital of Germany; Munich is in Bavaria.",
    "<information>Doc 1 (Title: Paris) text</information>",
    "Mount Everest is Earth's highest mountain above sea level.",
]

# Corpus in Search-R1 layout: title (quoted, as wiki-18) on the first line, then the text.
CORPUS = [
    ("d0", '"Paris"\nParis is the capital and most populous city of France, on the Seine.'),
    ("d1", '"Berlin"\nBerlin is the capital of Germany and its largest city.'),
    ("d2", '"Mount Everest"\nMount Everest is the highest mountain above sea level, in the Himalayas.'),
    ("d3", '"Amazon River"\nThe Amazon is a river in South America carrying the most water.'),
    ("d4", '"Marie Curie"\nMarie Curie was a physicist and chemist who researched radioactivity.'),
    ("d5", '"Python (programming language)"\nPython is a programming language created by Guido van Rossum.'),
    ("d6", '"Great Wall of China"\nThe Great Wall of China is a series of fortifications in northern China.'),
    ("d7", '"Tokyo"\nTokyo is the capital of Japan and its most populous metropolis.'),
]


class BPEAdapter:
    """A `tokenizers.Tokenizer` behind the `TokenizerLike` protocol (no special tokens)."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


@pytest.fixture(scope="session")
def bpe_tokenizer() -> BPEAdapter:
    tok = Tokenizer(models.BPE())
    # Byte-level: every string round-trips, and cutting ids can split a multi-byte character —
    # the awkward case observation truncation must survive.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TOKENIZER_TEXTS, trainer=trainer)
    return BPEAdapter(tok)


@pytest.fixture()
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc_id, contents in CORPUS:
            f.write(json.dumps({"id": doc_id, "contents": contents}) + "\n")
    return str(path)
