"""A corpus of real English texts that every machine running the benchmarks already holds, and
tokenizers trained on it.

The texts are the paragraphs of the docstrings of the running Python's standard library
(modules, classes, functions, in file order): prose written by people, of the lengths prose
has (a few words to a few hundred), no download needed, the same on every machine with the same
Python version. Code examples (``>>>`` lines), tables and mostly-symbol paragraphs are left out,
whitespace is collapsed, duplicates dropped, and the order is a seeded shuffle, so that any
prefix mixes the library's modules.

Tokenizers (``wordpiece``: BERT-style, lowercased, ``[CLS] text [SEP]``; ``byte_bpe``:
byte-level BPE, ``text <|endoftext|>``, as decoder embedders tokenize) are trained on the same
texts with the ``tokenizers`` library, so that token counts per text are those of a subword
tokenizer of a real vocabulary size, not of whitespace words.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sysconfig

import numpy as np

__all__ = ["CORPUS_NAME", "byte_bpe", "describe", "texts", "wordpiece"]

CORPUS_NAME = "Python standard library docstrings"
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
_SPACE = re.compile(r"\s+")


def _paragraphs(doc: str):
    for block in re.split(r"\n\s*\n", doc):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "...", "$ ", "|", "+--", "==", "--")) for line in lines):
            continue
        text = _SPACE.sub(" ", " ".join(lines)).strip()
        words = text.split(" ")
        letters = sum(c.isalpha() for c in text)
        if len(words) >= 3 and letters >= 0.6 * len(text):
            yield text


def _docstrings(path: pathlib.Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


@functools.cache
def _all_texts(seed: int) -> tuple[str, ...]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    seen: dict[str, None] = {}
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        for doc in _docstrings(path):
            for text in _paragraphs(doc):
                seen.setdefault(text)
    unique = list(seen)
    order = np.random.default_rng(seed).permutation(len(unique))
    return tuple(unique[i] for i in order)


def texts(n: int, seed: int = 0) -> list[str]:
    """The first ``n`` texts of the corpus (all of them when it holds fewer; see :func:`describe`)."""
    if n < 0:
        raise ValueError(f"bench.corpus.texts(): expected n >= 0, got {n}")
    return list(_all_texts(seed)[:n])


def describe() -> str:
    """One line for a result file: where the texts come from and how many there are."""
    import sys

    return f"{CORPUS_NAME} (Python {sys.version.split()[0]}), {len(_all_texts(0))} paragraphs"


@functools.cache
def wordpiece(vocab: int, max_length: int = 512, seed: int = 0):
    """A BERT-style fast tokenizer (lowercased WordPiece, ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2,
    ``[SEP]`` 3, ``[MASK]`` 4) of at most ``vocab`` ids, trained on the corpus; truncates to
    ``max_length`` tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        _all_texts(seed), trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=max_length,
        truncation_side="right",
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


@functools.cache
def byte_bpe(vocab: int, max_length: int = 512, padding_side: str = "right", seed: int = 0):
    """A byte-level BPE fast tokenizer of at most ``vocab`` ids trained on the corpus, as decoder
    embedders tokenize: no BOS, ``<|endoftext|>`` (id 0) appended to every text and used as the
    pad token, padding on ``padding_side``; truncates to ``max_length`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _all_texts(seed),
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=[eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B:1 {eos}:1", special_tokens=[(eos, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=max_length, eos_token=eos, pad_token=eos, padding_side=padding_side
    )
