"""The texts `kvcache eval kv-quality` and `kvcache bench spec-decode` read: a shipped English prose corpus and
synthetic passkey prompts.

The corpus, data/stdlib_docstrings.txt, is the documentation strings of a few CPython 3.11.7 standard
library modules (logging, email, doctest, pdb, ...), grouped into documents by topic: English prose
written by the Python developers, under the PSF License Agreement (Copyright (c) 2001-2023 Python
Software Foundation; All Rights Reserved), which permits redistributing it. Only prose paragraphs were
kept: doctest examples, indented code and lists, and paragraphs of fewer than 12 words were dropped.
It was generated once with `python -m kvcache.bench.corpus --regenerate` and is shipped as it is, so
that results do not depend on the Python version that runs the evaluation (docstrings change between
releases). Each of its 8 documents is 3,200 to 4,100 tokens long with the demo model's tokenizer.

The passkey prompts are Mohtashami & Jaggi (2023), "Landmark Attention: Random-Access Infinite
Context Length for Transformers": an instruction, filler sentences repeated to the wanted length, one
sentence giving a 5-digit pass key at a chosen depth, and a question.
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

CORPUS_FILE = "stdlib_docstrings.txt"
_HEADER = re.compile(r"^=== (.+) ===$", re.MULTILINE)

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER = "The pass key is"  # the prompt ends with it: the reply starts with the key


def passkey_sentence(key: int) -> str:
    """The sentence that hides `key`."""
    return f"The pass key is {key}. Remember it. {key} is the pass key."


@dataclass(frozen=True)
class Document:
    """One document of the corpus: a title and its prose."""

    title: str
    text: str


def load_corpus(path: str | None = None) -> list[Document]:
    """The documents of the shipped corpus (or of `path`, in the same format: `=== title ===` lines
    start documents, the text follows)."""
    if path is None:
        text = resources.files("kvcache.bench").joinpath("data", CORPUS_FILE).read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    heads = list(_HEADER.finditer(text))
    if not heads:
        raise ValueError(f"{path or CORPUS_FILE} has no '=== title ===' line: not a corpus file")
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return [Document(h.group(1), text[h.end():end].strip()) for h, end in zip(heads, ends)]


def document_windows(tokenize: Callable[[str], list[int]], num_docs: int, length: int,
                     documents: list[Document] | None = None) -> list[list[int]]:
    """The first `length` tokens of each of the first `num_docs` documents (in corpus order).

    Raises ValueError if fewer than `num_docs` documents are that long.
    """
    if num_docs < 1 or length < 2:
        raise ValueError(f"need at least 1 document of at least 2 tokens; got {num_docs} of {length}")
    docs = load_corpus() if documents is None else documents
    windows, lengths = [], []
    for doc in docs:
        ids = tokenize(doc.text)
        lengths.append(len(ids))
        if len(ids) >= length:
            windows.append(ids[:length])
            if len(windows) == num_docs:
                return windows
    raise ValueError(f"the corpus has {len(windows)} documents of at least {length:,} tokens (lengths "
                     f"{', '.join(f'{n:,}' for n in lengths)}); asked for {num_docs}")


def passkey_keys(depths: list[float], per_depth: int, seed: int = 0) -> list[tuple[float, int]]:
    """(depth, 5-digit key) for every trial: `per_depth` keys at each depth, the same for every seed."""
    rng = random.Random(seed)
    return [(d, rng.randint(10_000, 99_999)) for d in depths for _ in range(per_depth)]


def plain_prompt(text: str) -> str:
    """The passkey text as a plain prompt: the question, then the start of the answer."""
    return text + " " + PASSKEY_ANSWER


def passkey_prompt(key: int, depth: float, target_tokens: int, count_tokens: Callable[[str], int],
                   wrap: Callable[[str], str] = plain_prompt) -> str:
    """A passkey prompt of about `target_tokens` tokens (as `count_tokens` counts them): the
    instruction, filler with the key sentence after a fraction `depth` of it (0: right after the
    instruction, 1: right before the question), the question, all passed through `wrap` (which adds
    the start of the answer, and a chat template if wanted).

    The filler line is repeated as often as fits: the prompt is at most `target_tokens` and within
    one filler line (about 25 tokens) of it, give or take a token where pieces merge.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    fixed = count_tokens(wrap(" ".join((PASSKEY_INTRO, passkey_sentence(key), PASSKEY_QUESTION))))
    per_filler = count_tokens(" " + PASSKEY_FILLER)
    n = (target_tokens - fixed) // per_filler
    if n < 1:
        raise ValueError(f"a passkey prompt of {target_tokens:,} tokens leaves no room for filler "
                         f"(the instruction, key and question take {fixed} tokens)")
    at = round(depth * n)
    parts = [PASSKEY_INTRO] + [PASSKEY_FILLER] * at + [passkey_sentence(key)] + [PASSKEY_FILLER] * (n - at)
    return wrap(" ".join(parts + [PASSKEY_QUESTION]))


# ---- regenerating the corpus file (once; the file is shipped) -------------------------------------------

# document title -> standard library modules whose docstrings make it up
_SOURCES = {
    "logging": ["logging", "logging.handlers"],
    "email and smtplib": ["email.message", "smtplib"],
    "doctest": ["doctest"],
    "pdb and bdb": ["pdb", "bdb"],
    "difflib and textwrap": ["difflib", "textwrap", "string"],
    "http and urllib": ["http.client", "http.server", "urllib.request"],
    "threading, queue and subprocess": ["threading", "queue", "sched", "subprocess"],
    "os, shutil and pathlib": ["os", "shutil", "pathlib"],
}
_MAX_DOC_CHARS = 17_000  # about 4,000 tokens; keeps the file under 150 KB


def _docstrings(module) -> list[str]:
    """Docstrings of a module, its public functions and classes and their methods, in definition order."""
    import inspect
    out, seen = [], set()

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            out.append(doc)

    add(module)
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            add(obj)
            for mname, member in vars(obj).items():
                if not mname.startswith("_") and inspect.isfunction(member):
                    add(member)
        elif inspect.isfunction(obj):
            add(obj)
    return out


def _prose(doc: str) -> list[str]:
    """The paragraphs of a docstring that are English prose, each joined onto one line."""
    keep = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(l.lstrip().startswith((">>>", "...", "$ ")) or l.startswith("    ") for l in lines):
            continue
        text = " ".join(l.strip() for l in lines)
        words = text.split()
        if len(words) < 12 or sum(w.strip(".,;:()'\"").isalpha() for w in words) < 0.75 * len(words):
            continue
        keep.append(text)
    return keep


def regenerate(path: str) -> None:
    """Write the corpus file from this Python's standard library docstrings (run once, then ship it)."""
    import importlib
    import sys
    chunks = []
    for title, modules in _SOURCES.items():
        paras: list[str] = []
        for name in modules:
            paras += [p for d in _docstrings(importlib.import_module(name)) for p in _prose(d)]
        body, size = [], 0
        for p in paras:
            if size + len(p) > _MAX_DOC_CHARS:
                break
            body.append(p)
            size += len(p) + 2
        v = sys.version_info
        chunks.append(f"=== {title} (Python {v.major}.{v.minor}.{v.micro} docstrings: {', '.join(modules)}) ===\n\n"
                      + "\n\n".join(body) + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(chunks))


if __name__ == "__main__":
    import argparse
    import os
    parser = argparse.ArgumentParser(description="regenerate the shipped kv-quality corpus file")
    parser.add_argument("--regenerate", action="store_true", required=True)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "data", CORPUS_FILE))
    a = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    regenerate(a.out)
    print(f"wrote {a.out}")
