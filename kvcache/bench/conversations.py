"""The seeded conversations `kvcache bench serve` sends: random words from a fixed list of short common English
words (about one token each), as single requests (random lengths, optionally behind a shared prefix), groups
sharing a prefix, or multi-turn conversations; and their Poisson arrival times."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Short, common words: each is one token (with its leading space) in the usual BPE vocabularies,
# so a prompt of N words is about N tokens. The true counts come from the server's usage.
WORDS = tuple("""
the of and to in is it you that he was for on are as with his they at be this have from or one had by
word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him into time has look two more write
go see number no way could people my than first water been call who oil its now find long down day did
get come made may part over new sound take only little work know place year live me back give most very
after thing our just name good man think say great where help through much before line right too mean
old any same tell boy follow came want show also around form three small set put end does another well
large must big even such turn here why ask went men read need land different home us move try kind hand
picture again change off play spell air away animal house point page letter mother answer found study
still learn should world high every near add food between own below country plant last school father
keep tree never start city earth eye light thought head under story saw left few while along might close
something seem next hard open example begin life always those both paper together got group often run
""".split())


@dataclass(slots=True)
class Conversation:
    """One client's requests in order; turn t+1 is sent after turn t finished, with the whole history."""

    system: str  # system prompt (multi-turn) or "" for none
    turns: list[str]  # user messages
    output_lens: list[int]  # max_tokens of each turn (tokens)


def words(rng: np.random.Generator, n: int) -> str:
    """`n` words of WORDS drawn with `rng`, space-separated."""
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def random_conversations(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                         shared_prefix_len: int, seed: int) -> list[Conversation]:
    """`num_prompts` single requests of uniformly random input/output lengths (words/tokens), each behind
    the same `shared_prefix_len`-word prefix (0: none), seeded."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {shared_prefix_len}")
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    outs = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    prefix = words(rng, shared_prefix_len)
    return [Conversation("", [" ".join(filter(None, [prefix, words(rng, int(n))]))], [int(o)])
            for n, o in zip(ins, outs)]


def shared_prefix_conversations(groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                                seed: int, shuffle: bool = False) -> list[Conversation]:
    """G x R single requests, request i in group i % G: the group's `prefix_len` words then `suffix_len` of its own;
    with `shuffle`, in a seeded random order instead (the groups interleaved as traffic would, not in a cycle that a
    round-robin over a divisor of G would follow group by group)."""
    if min(groups, per_group, prefix_len, suffix_len) < 1:
        raise ValueError(f"--num-groups, --requests-per-group, --prefix-len and --suffix-len must be >= 1, got "
                         f"{groups}, {per_group}, {prefix_len}, {suffix_len}")
    rng = np.random.default_rng(seed)
    prefixes = [words(rng, prefix_len) for _ in range(groups)]
    convs = [Conversation("", [prefixes[i % groups] + " " + words(rng, suffix_len)], [output_len])
             for i in range(groups * per_group)]
    if shuffle:
        convs = [convs[i] for i in rng.permutation(len(convs))]
    return convs


def multi_turn_conversations(conversations: int, turns: int, prefix_len: int, suffix_len: int, output_len: int,
                             seed: int, system_prompts: int = 1, shuffle: bool = False) -> list[Conversation]:
    """C conversations of T turns, conversation i behind system prompt i % S (`prefix_len` words; S = 1: one
    shared by all); each user message `suffix_len` words. With `shuffle`, the conversations start in a seeded random
    order (the system prompts interleaved, not in a cycle)."""
    if min(conversations, turns, prefix_len, suffix_len, system_prompts) < 1:
        raise ValueError(f"--num-conversations, --num-turns, --prefix-len, --suffix-len and --num-system-prompts must "
                         f"be >= 1, got {conversations}, {turns}, {prefix_len}, {suffix_len}, {system_prompts}")
    rng = np.random.default_rng(seed)
    systems = [words(rng, prefix_len) for _ in range(system_prompts)]
    convs = [Conversation(systems[i % system_prompts], [words(rng, suffix_len) for _ in range(turns)],
                          [output_len] * turns) for i in range(conversations)]
    if shuffle:
        convs = [convs[i] for i in rng.permutation(len(convs))]
    return convs


def arrival_offsets(n: int, request_rate: float, seed: int) -> np.ndarray:
    """Start times (seconds after the first) of `n` Poisson arrivals at `request_rate` per second; all 0 at inf."""
    if n < 1 or math.isinf(request_rate):
        return np.zeros(max(n, 0))
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
