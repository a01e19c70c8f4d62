"""What every `kvcache eval` command is made of: a checkpoint loaded once with its corpus documents, engines
built over it, the passkey trials, the quality metrics against a baseline, the table on stdout, the plot and the
JSON. kv_quality.py (KV formats), eviction.py (eviction policies) and weights.py (weight formats) are
configurations of these: which engines they build, what they score, which columns they print.

Heavy modules (torch, numpy, tqdm, matplotlib) are imported where they are used: the CLI imports the eval
modules to build its parser, and `kvcache plan` stays torch-free.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvcache.bench.corpus import (PASSKEY_ANSWER, PASSKEY_QUESTION, document_windows, load_corpus, passkey_keys,
                                 passkey_prompt, plain_prompt)

if TYPE_CHECKING:
    import torch

MODEL_HELP = "Hugging Face model directory or GGUF file (default: SmolLM2-135M demo)"
DEFAULT_MODEL_LEN = 2048  # tokens, where a checkpoint's config names no context length
_ROWS = 256  # logit rows per metric chunk: bounds the softmax temporaries to ~50 MB


# ---- the checkpoint and its corpus ----------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A model loaded once for a whole evaluation (every engine shares its weights), its context length in
    tokens, and when the evaluation started (perf_counter seconds, loading included)."""

    loaded: Any
    model_len: int
    started: float

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer."""
        return self.loaded.tokenizer

    def documents(self, num_docs: int, length: int, corpus: str | None = None) -> list[list[int]]:
        """The first `length` token ids of `num_docs` documents of the corpus file `corpus` (the shipped one if
        None); ValueError where too few documents are that long."""
        return document_windows(lambda s: self.tokenizer.encode(s), num_docs, length,
                                load_corpus(corpus) if corpus else None)

    def wall_s(self) -> float:
        """Seconds since the evaluation started."""
        return time.perf_counter() - self.started


def load_checkpoint(model: str | None) -> Checkpoint:
    """The checkpoint at `model` (the demo model if None), with the clock started before loading it."""
    from kvcache.models.loader import read_checkpoint
    started = time.perf_counter()
    loaded = read_checkpoint(model)
    model_len = getattr(loaded.config, "max_position_embeddings", None) or DEFAULT_MODEL_LEN
    return Checkpoint(loaded, model_len, started)


# ---- metrics --------------------------------------------------------------------------------------------

def token_metrics(ref_logits: torch.Tensor, logits: torch.Tensor,
                  targets: torch.Tensor) -> tuple[float, int, float, float]:
    """Sums over rows of [rows, vocab] logits: KL(P_ref || P) in nats, argmax agreements, and the
    negative log-likelihood (nats) of `targets` under the reference and under `logits`."""
    import torch
    if ref_logits.shape != logits.shape or ref_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits {tuple(ref_logits.shape)} and {tuple(logits.shape)} with {targets.shape[0]} "
                         "targets: shapes must match")
    kl = nll_ref = nll = 0.0
    top1 = 0
    for s in range(0, targets.shape[0], _ROWS):
        lp_ref = torch.log_softmax(ref_logits[s:s + _ROWS].float(), dim=-1)
        lp = torch.log_softmax(logits[s:s + _ROWS].float(), dim=-1)
        t = targets[s:s + _ROWS].unsqueeze(1)
        # p_ref * (log p_ref - log p); rows are independent, clamp the per-row float rounding at 0
        kl += (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0).double().sum().item()
        top1 += int((lp_ref.argmax(-1) == lp.argmax(-1)).sum())
        nll_ref -= lp_ref.gather(1, t).double().sum().item()
        nll -= lp.gather(1, t).double().sum().item()
    return kl, top1, nll_ref, nll


def ppl_delta_pct(ppl: float, ppl_ref: float) -> float:
    """Perplexity change in percent: (ppl / ppl_ref - 1) * 100."""
    return (ppl / ppl_ref - 1.0) * 100.0


@dataclass
class QualityStats:
    """Running sums over scored positions (tokens) of one variant against the baseline."""

    positions: int = 0
    kl_sum: float = 0.0  # nats
    top1_sum: int = 0
    nll_sum: float = 0.0  # nats, of the actual next tokens under this variant
    nll_ref_sum: float = 0.0  # the same under the baseline

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add the rows of one document: its logits under the baseline and this variant, and its next tokens."""
        kl, top1, nll_ref, nll = token_metrics(ref_logits, logits, targets)
        self.positions += targets.shape[0]
        self.kl_sum += kl
        self.top1_sum += top1
        self.nll_sum += nll
        self.nll_ref_sum += nll_ref

    @property
    def kl(self) -> float:
        """Mean KL(P_full || P_variant) per position, nats."""
        return self.kl_sum / self.positions

    @property
    def top1(self) -> float:
        """Share of positions whose argmax token equals the baseline's."""
        return self.top1_sum / self.positions

    @property
    def ppl(self) -> float:
        """Perplexity of the actual next tokens under this variant."""
        return math.exp(self.nll_sum / self.positions)

    @property
    def ppl_ref(self) -> float:
        """The same under the baseline."""
        return math.exp(self.nll_ref_sum / self.positions)

    def summary(self, baseline_ppl: float) -> dict:
        """The figures every table and JSON file reports: KL (nats), top-1, perplexity and its change in percent
        against `baseline_ppl`."""
        return {"kl": self.kl, "top1": self.top1, "ppl": self.ppl,
                "ppl_delta_pct": ppl_delta_pct(self.ppl, baseline_ppl)}


def compare_scores(reference, candidates: dict, docs: list[list[int]], start: int, progress: bool = False,
                   desc: str = "scoring") -> tuple[QualityStats, dict]:
    """Teacher-forced logits of each document from `reference` and from each of `candidates` (name -> a
    function (token_ids, start) -> logits, as LLMEngine.score), scored at positions start .. len - 2
    against the next tokens. The reference is compared with itself too (KL 0, top-1 1: a check of the
    metrics). One document's logits are held at a time."""
    import torch
    from tqdm import tqdm
    base = QualityStats()
    stats = {name: QualityStats() for name in candidates}
    bar = tqdm(total=len(docs) * (1 + len(candidates)), desc=desc, disable=not progress, file=sys.stderr)
    for ids in docs:
        targets = torch.tensor(ids[start + 1:])
        ref = reference(ids[:-1], start)
        base.add(ref, ref, targets)
        bar.update(1)
        for name, score in candidates.items():
            stats[name].add(ref, score(ids[:-1], start), targets)
            bar.update(1)
        del ref
    bar.close()
    return base, stats


def evaluate_engines(baseline, engines: dict, docs: list[list[int]], warmup: int, chunk_size: int | None = None,
                     progress: bool = False) -> tuple[QualityStats, dict[str, QualityStats]]:
    """Score every document through the baseline engine and each engine of `engines` (name -> engine).

    Positions `warmup` .. len - 2 of each document are scored (the last token has no next token).
    The baseline is compared with itself too (KL 0, top-1 1: a check of the metrics).
    """
    for ids in docs:
        if not 0 <= warmup < len(ids) - 1:
            raise ValueError(f"warmup {warmup} must leave positions to score in a {len(ids)}-token document")

    def scorer(engine):
        return lambda ids, start: engine.score(ids, start=start, chunk_size=chunk_size)
    return compare_scores(scorer(baseline), {name: scorer(e) for name, e in engines.items()}, docs, warmup, progress)


# ---- engines --------------------------------------------------------------------------------------------

def pool_bytes(loaded, dtype: str, requests: int, tokens: int) -> int:
    """KV bytes (as the planner counts them) for `requests` requests of `tokens` tokens in `dtype`'s
    default blocks, residual blocks included, plus one spare block."""
    from kvcache.memory.kv_cache_manager import blocks_for
    from kvcache.plan.kv_bytes import default_block_size, kv_bytes_per_token, sequence_blocks
    from kvcache.plan.shape import shape_from_config
    shape = shape_from_config(loaded.config.to_dict())
    bs = default_block_size(dtype)
    blocks = requests * (blocks_for(tokens, bs) + sequence_blocks(shape, dtype, bs)) + 1
    return blocks * bs * kv_bytes_per_token(shape, dtype)


def build_engine(loaded, dtype: str, kv_cache_memory: int, max_model_len: int, **config):
    """An engine over the loaded checkpoint, computing in float32 and storing its KV cache as `dtype`
    in a pool of `kv_cache_memory` bytes; `config` sets other EngineConfig fields."""
    from kvcache.config import EngineConfig
    from kvcache.engine.llm_engine import LLMEngine
    cfg = EngineConfig(model=loaded.source, kv_cache_dtype=dtype, dtype="float32", kv_cache_memory=kv_cache_memory,
                       max_model_len=max_model_len, **config)
    return LLMEngine(cfg, loaded)


def each_engine(configs: Iterable, build: Callable, measure: Callable, desc: str) -> list:
    """measure(build(config), config) for each config in turn, with a progress bar on stderr. One engine is
    alive at a time: each is freed before the next is built, so every pool gets the same memory."""
    from tqdm import tqdm
    out = []
    for config in tqdm(list(configs), desc=desc, file=sys.stderr):
        engine = build(config)
        out.append(measure(engine, config))
        del engine
        gc.collect()
    return out


def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt's CompletionOutput, generated greedily in one batch (ignoring EOS); checks for leaks."""
    from kvcache.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"greedy-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = engine.run_to_completion()
    engine.check_no_leaks()
    return [done[rid].outputs[0] for rid in ids]


def random_prompts(engine, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` uniformly random token ids, none of them special or end-of-sequence."""
    import numpy as np
    vocab = engine.model.config.vocab_size
    special = set(getattr(engine.tokenizer, "all_special_ids", []) or []) | engine.eos_token_ids
    allowed = np.setdiff1d(np.arange(vocab), np.array(sorted(special), dtype=np.int64))
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, len(allowed), length)].tolist() for _ in range(count)]


# ---- passkey trials -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt: its key, the depth of the key (0..1) and the prompt's token ids."""

    depth: float
    key: int
    token_ids: list[int]


def chat_wrap(tokenizer):
    """text -> the chat template with `text` as the user's message and the reply begun as "The pass key is"."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use --passkey-prompt raw")

    def wrap(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False) + PASSKEY_ANSWER
    return wrap


def passkey_texts(tokenizer, depths: list[float], per_depth: int, length: int, prompt: str = "chat",
                  seed: int = 0) -> tuple[list[tuple[float, int, str]], Callable[[str], list[int]]]:
    """The passkey prompts as (depth, key, text), `per_depth` keys at each depth, about `length` tokens each,
    and the function that tokenizes them.

    `prompt`: "chat" puts the text in a user message of the chat template and starts the
    assistant's reply with "The pass key is"; "raw" ends the plain text with it.
    """
    if prompt not in ("chat", "raw"):
        raise ValueError(f"passkey prompt must be chat or raw, got {prompt!r}")
    wrap = chat_wrap(tokenizer) if prompt == "chat" else plain_prompt

    def encode(text: str) -> list[int]:  # the template writes its special tokens itself
        return tokenizer.encode(text, add_special_tokens=prompt == "raw")

    texts = [(d, k, passkey_prompt(k, d, length, lambda s: len(encode(s)), wrap))
             for d, k in passkey_keys(depths, per_depth, seed)]
    return texts, encode


def passkey_trials(tokenizer, depths: list[float], per_depth: int, length: int, prompt: str = "chat",
                   seed: int = 0) -> list[PasskeyTrial]:
    """The passkey prompts (see passkey_texts), tokenized whole."""
    texts, encode = passkey_texts(tokenizer, depths, per_depth, length, prompt, seed)
    return [PasskeyTrial(d, k, encode(text)) for d, k, text in texts]


@dataclass(frozen=True)
class SplitTrial:
    """One passkey prompt cut before its question: the key, its depth (0..1), and the token ids of the
    context (instruction, filler, key sentence, filler) and of the question (question, end of the chat
    template, start of the answer), tokenized separately. `joint`: whether tokenizing the whole prompt
    at once gives the same ids (a merge across the cut would differ)."""

    depth: float
    key: int
    context_ids: list[int]
    question_ids: list[int]
    joint: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def split_passkey_text(text: str) -> tuple[str, str]:
    """A passkey prompt's text cut right before " What is the pass key?": (context, question)."""
    at = text.rfind(" " + PASSKEY_QUESTION)
    if at < 0:
        raise ValueError(f"the passkey prompt has no {PASSKEY_QUESTION!r}: cannot split it")
    return text[:at], text[at:]


def split_passkey_trials(tokenizer, depths: list[float], per_depth: int, length: int,
                         seed: int = 0) -> list[SplitTrial]:
    """The chat-template passkey prompts of `kvcache eval kv-quality` (`per_depth` keys at each depth, about
    `length` tokens each, the same keys for a seed), each split into context and question tokens."""
    texts, encode = passkey_texts(tokenizer, depths, per_depth, length, "chat", seed)
    trials = []
    for d, k, text in texts:
        context, question = split_passkey_text(text)
        ctx, q = encode(context), encode(question)
        trials.append(SplitTrial(d, k, ctx, q, ctx + q == encode(text)))
    return trials


def answer_tokens(tokenizer, key: int, output_ids: list[int]) -> list[int] | None:
    """The shortest prefix of `output_ids` whose text contains `key`, or None if the whole output lacks it."""
    for n in range(1, len(output_ids) + 1):
        if str(key) in tokenizer.decode(output_ids[:n], skip_special_tokens=True):
            return output_ids[:n]
    return None


def passkey_accuracy(trials: list, correct: list[bool]) -> dict:
    """The share of correct trials ("acc", None without trials), how many ("correct"), and the share at each
    depth ("by_depth": '0.5' -> 0..1, in the trials' order of depths)."""
    by_depth: dict[str, list[bool]] = {}
    for t, ok in zip(trials, correct):
        by_depth.setdefault(f"{t.depth:g}", []).append(ok)
    return {"acc": sum(correct) / len(correct) if correct else None, "correct": sum(correct),
            "by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()}}


# ---- arguments ------------------------------------------------------------------------------------------

def add_text_args(p: argparse.ArgumentParser, num_docs: int, depths: str, passkeys_per_depth: int) -> None:
    """The arguments the evaluations with passkeys take for the model, the corpus and the passkey prompts."""
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--num-docs", type=int, default=num_docs, help="corpus documents to score (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (tokens) when scoring (default: %(default)s)")
    p.add_argument("--corpus", default=None, help="a corpus file of '=== title ===' documents (default: the shipped "
                   "Python docstrings)")
    p.add_argument("--depths", default=depths, help="passkey depths, fractions of the filler (default: %(default)s)")
    p.add_argument("--passkeys-per-depth", type=int, default=passkeys_per_depth, help="passkey prompts at each depth (default: %(default)s)")
    p.add_argument("--passkey-len", type=int, default=1024, help="tokens of each passkey prompt (about) (default: %(default)s)")
    p.add_argument("--skip-passkey", action="store_true", help="skip the passkey retrieval test (default: %(default)s)")
    p.add_argument("--skip-capacity", action="store_true", help="skip the capacity (memory and throughput) runs (default: %(default)s)")


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]: passkey depths in [0, 1]; ValueError otherwise."""
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--depths takes fractions separated by commas, got {text!r}") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must lie in [0, 1], got {text!r}")
    return depths


def check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """ValueError naming the first of the integer options `names` that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")


# ---- the table ------------------------------------------------------------------------------------------

def fmt(v, spec: str, none: str = "-") -> str:
    """`v` formatted by `spec`; `none` where there is no value, and a string as it is."""
    if v is None:
        return none
    return v if isinstance(v, str) else format(v, spec)


@dataclass(frozen=True)
class Column:
    """One column of a table: its title, its width in characters, the format spec of its values (fmt), whether
    it is left-aligned, what always stands before it, and what follows each value (inside the width)."""

    title: str
    width: int
    spec: str = ""
    left: bool = False
    gap: str = ""
    suffix: str = ""

    def cell(self, text: str) -> str:
        """`text` padded to the column's width, after its gap."""
        return self.gap + (format(text, f"<{self.width}") if self.left else format(text, f">{self.width}"))


@dataclass(frozen=True)
class Table:
    """Columns printed as a header, a rule as long as it and one line per row; `note` ends the header."""

    columns: tuple[Column, ...]
    note: str = ""

    def header(self) -> str:
        """The titles, each padded as its column's values are, and the note."""
        return "".join(c.cell(c.title) for c in self.columns) + self.note

    def line(self, values: list) -> str:
        """One row: each value formatted by its column (None as '-')."""
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for a table of {len(self.columns)} columns")
        return "".join(c.cell(fmt(v, c.spec) + c.suffix) for c, v in zip(self.columns, values))

    def print(self, rows: Iterable[list]) -> None:
        """The header, the rule and the rows on stdout."""
        head = self.header()
        print(head)
        print("-" * len(head))
        for values in rows:
            print(self.line(values))


# ---- the plot and the report ----------------------------------------------------------------------------

def new_figure(path: str, nrows: int, ncols: int, size: tuple[float, float]):
    """(pyplot, figure, axes) for a PNG to be written at `path` (its folder is created), drawn off-screen."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, axes = plt.subplots(nrows, ncols, figsize=size)
    return plt, fig, axes


def finish_axis(ax, ticks: list, labels: list[str], xlabel: str, ylabel: str, base: float = 10,
                tick_style: dict | None = None, yscale: dict | None = None) -> None:
    """A panel's logarithmic x axis (of `base`, ticks at `ticks` only, written as `labels` in `tick_style`), its
    y scale (set_yscale's arguments; after the minor ticks are turned off, so that it keeps its own), its axis
    labels and a light grid."""
    ax.set_xscale("log", base=base)
    ax.set_xticks(ticks, labels, **(tick_style or {}))
    ax.minorticks_off()
    if yscale:
        ax.set_yscale(**yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)


def save_figure(plt, fig, path: str, title: str) -> None:
    """Title the figure, lay it out and write it to `path` (PNG, 120 dpi)."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: dict, print_results: Callable[[dict], None], json_path: str,
           plot: Callable[[dict, str], None] | None = None, plot_path: str = "") -> int:
    """Print the results, write them as JSON (with the machine) and draw them, each where asked; exit status 0."""
    print_results(results)
    if json_path:
        from kvcache.bench.report import write_json
        write_json(json_path, results)
    if plot is not None and plot_path:
        plot(results, plot_path)
        print(f"wrote {plot_path}")
    return 0
