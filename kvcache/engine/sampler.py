"""Picks the next token of every sequence in a batch from its logits.

Stages, in vLLM's order: logprobs of the raw logits; repetition, frequency and presence
penalties; min_tokens masking of stop tokens; then argmax for greedy rows, or temperature,
top-k, top-p, min-p and a draw for the others. Each stage runs only on the rows that need it,
batched over those rows.

Draws are inverse-CDF: one uniform number per row, searched in the row's cumulative weights.
A seeded row takes its number from its own generator, and every stage works on each row
independently of the others, so its tokens do not depend on what else is in the batch.

Whatever the logits, a sampled id is in [0, vocab): a row whose raw logits hold NaN or an infinity
gets no token but an error (the engine fails that request alone); a penalty that overflows float32
saturates at its largest value, and temperature divides logits already shifted to a maximum of 0, so
no stage makes inf - inf = NaN; an id outside the row is refused as a last resort.
"""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

from kvcache.engine.sampling_params import SamplingParams
from kvcache.models import cpu_kernels

# Top-k/top-p rows look for their kept set among this many most likely tokens first, and
# widen to the next size (the last being the whole vocabulary) only if it may lie beyond:
# topk(64) costs ~1/40 of a full-vocabulary sort, and most rows are decided within it.
CANDIDATE_WIDTHS = (64, 1024)


@dataclass(slots=True)
class SamplingRow:
    """One row of the batch's logits and what its sampler needs to know. The row holds its sequence's token list
    as it is (no copy: a step builds a row per running sequence, and only penalties and min_tokens read the
    tokens); the prompt is its first `num_prompt_tokens`."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request seeded generator, None = global RNG
    token_ids: list[int]  # the prompt, then the output so far
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # -1 in the rows of `errors`
    # Per row, when params.logprobs is not None: {sampled id: logprob, top ids: logprob},
    # from the raw logits (before penalties and temperature). Otherwise None.
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it has no token


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None = None) -> SampleResult:
    """Sample one token per row of logits [len(rows), vocab] (fp32; not modified).

    Rows whose logits are not finite are named in `errors` (see the module docstring). Unless a row asks for
    logprobs, the device is read once: the sampled ids and each row's finiteness come back in one transfer.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {list(logits.shape)}")
    work = logits.float().contiguous()  # no-ops for the fp32 logits the runner produces
    argmax, finite = _argmax_finite(work)

    logprob_rows, greedy_rows, random_rows = [], [], []
    processed = False
    for i, row in enumerate(rows):
        p = row.params
        if p.logprobs is not None:
            logprob_rows.append(i)
        processed = processed or _penalized(p) or row.num_output_tokens < p.min_tokens
        (greedy_rows if p.greedy else random_rows).append(i)
    if not (logprob_rows or processed or random_rows):
        return _finish(work.argmax(-1) if argmax is None else argmax, finite, [None] * len(rows), work.shape[1])
    # The stages below work in place: the caller's logits stay as they were.
    logits = work.clone() if work is logits and (processed or random_rows) else work

    # vLLM returns logprobs of the model's distribution, not of the processed one.
    raw_logprobs = _take(logits, logprob_rows).log_softmax(-1) if logprob_rows else None
    if processed or random_rows:
        logits.masked_fill_(~finite[:, None], 0.0)  # a failing row draws harmlessly; its token is dropped
    if processed:
        logits = _process(logits, rows, eos_token_id)

    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy_rows:
        # the first pass's ids stand while nothing has changed the logits (only rows that fail were zeroed since)
        ids = _take(logits, greedy_rows).argmax(-1) if argmax is None or processed else _take(argmax, greedy_rows)
        _put(tokens, greedy_rows, ids)
    if random_rows:
        _put(tokens, random_rows, _sample_random(_take(logits, random_rows), [rows[i] for i in random_rows]))

    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    if logprob_rows:
        counts = [rows[i].params.logprobs for i in logprob_rows]
        for i, d in zip(logprob_rows, _logprob_dicts(raw_logprobs, _take(tokens, logprob_rows), counts)):
            logprobs[i] = d
    return _finish(tokens, finite, logprobs, logits.shape[1])


def _argmax_finite(work: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(each row's argmax, where it came for free; whether each row is all finite). On the CPU the C++ kernel
    finds both in one pass over the logits (torch's isfinite().all() and argmax cost ~7 and ~3 ms on 64 rows of a
    49,152-token vocabulary here, the kernel ~0.5 ms for both); elsewhere torch's ops."""
    if work.device.type == "cpu" and work.numel():
        kernels = cpu_kernels.load()
        if kernels is not None:
            ids, finite = kernels.argmax_finite(work)
            return ids, finite
    return None, torch.isfinite(work).all(-1)


def _finish(tokens: torch.Tensor, finite: torch.Tensor, logprobs: list[dict[int, float] | None],
            vocab: int) -> SampleResult:
    """The result, from one device-to-host copy of the ids and the rows' finiteness."""
    n = tokens.numel()
    both = torch.cat([tokens, finite.long()]).tolist()
    result = SampleResult(both[:n], logprobs)
    for i, ok in enumerate(both[n:]):
        if not ok:
            result.token_ids[i], result.logprobs[i] = -1, None
            result.errors[i] = "the model produced non-finite logits (NaN or inf) for this sequence"
    return _checked(result, vocab)


def _checked(result: SampleResult, vocab: int) -> SampleResult:
    """Turn any id outside [0, vocab) into an error for its row: never hand one to the model."""
    for i, t in enumerate(result.token_ids):
        if not 0 <= t < vocab and i not in result.errors:
            result.token_ids[i] = -1
            result.errors[i] = f"the sampler drew token id {t}, outside the vocabulary [0, {vocab})"
    return result


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to logits [len(rows), vocab] in place.

    repetition_penalty divides positive logits (multiplies negative ones) of tokens seen in the
    prompt or the output; then frequency_penalty * count and presence_penalty * (count > 0) are
    subtracted for tokens in the output. Returns logits (a contiguous copy if it was not).
    """
    logits = logits.contiguous()
    vocab = logits.shape[1]
    flat = logits.view(-1)

    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = [rows[i].token_ids for i in rep]
        pos, owner = _positions(rep, seen, vocab, logits.device)
        if pos.numel():
            penalty = _dev([rows[i].params.repetition_penalty for i in rep], logits.device, logits.dtype)[owner]
            vals = flat[pos]
            # A token seen twice is written twice, with the same value computed from the original.
            flat[pos] = torch.where(vals > 0, vals / penalty, vals * penalty)

    fp = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0 or r.params.presence_penalty != 0]
    if fp:
        pos, _ = _positions(fp, [rows[i].output_token_ids for i in fp], vocab, logits.device)
        if pos.numel():
            # Dense counts: no data-dependent shapes, so no wait on the device (rows without these penalties
            # subtract 0, which changes no logit).
            counts = torch.zeros_like(logits)
            counts.view(-1).index_add_(0, pos, torch.ones(pos.numel(), dtype=logits.dtype, device=logits.device))
            frequency = _dev([r.params.frequency_penalty for r in rows], logits.device, logits.dtype)
            presence = _dev([r.params.presence_penalty for r in rows], logits.device, logits.dtype)
            logits.sub_(frequency[:, None] * counts).sub_(presence[:, None] * (counts > 0))
    return logits


def truncate(probs: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, then top-p, then min-p to rows of probabilities [len(params), vocab].

    Returns (weights, ids), both [len(params), width]: each row's most likely token ids in
    descending order of probability and their sampling weights (unnormalized), 0 where a
    token is dropped. Tokens beyond width are dropped. top-k keeps exactly k tokens (ties
    broken by torch.topk); top-p keeps the smallest prefix whose probability, renormalized
    after top-k, reaches top_p; min-p drops tokens below min_p times the most likely one.
    """
    n, vocab = probs.shape
    device = probs.device
    host_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_k = _dev(host_k, device)
    top_p = _dev([p.top_p for p in params], device, probs.dtype)
    min_p = _dev([p.min_p for p in params], device, probs.dtype)

    decided: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    pending = torch.arange(n, device=device)
    for width in (*(w for w in CANDIDATE_WIDTHS if w < vocab), vocab):
        sub = probs if len(pending) == n else probs[pending]
        if width == vocab:
            vals, ids = sub.sort(-1, descending=True)
        else:
            vals, ids = sub.topk(width, -1)
        k, p = top_k[pending], top_p[pending]
        vals.masked_fill_(torch.arange(width, device=device) >= k[:, None], 0)
        cum = vals.cumsum(-1)
        k_inside = k <= width
        # Top-p renormalizes over the top-k set; without top-k that is the whole row, whose sum is 1.
        total = torch.where(k_inside, cum.gather(1, (k.clamp(max=width) - 1)[:, None]).squeeze(1), 1.0)
        # Probability beyond the head is unknown, so a row is decided here only if its top-k
        # ends inside the head, or it has no top-k and the head alone reaches top_p < 1.
        if width < vocab:
            done = k_inside | ((k == vocab) & (p < 1) & (cum[:, -1] >= p))
        else:
            done = torch.ones_like(k_inside)
        # Exclusive cumsum < threshold keeps the smallest prefix reaching it, and at least the first token.
        keep = (cum - vals < (p * total)[:, None]) | (p >= 1)[:, None]
        keep[:, 0] = True  # even when p x total underflows to 0 (top_p=1e-46 in float32)
        vals.mul_(keep)
        vals.masked_fill_(vals < (min_p[pending] * vals[:, 0])[:, None], 0)
        # All decided by top-k alone is known on the host; otherwise ask the device.
        if (len(pending) == n and all(k <= width for k in host_k)) or bool(done.all()):
            decided.append((pending, vals, ids))
            break
        decided.append((pending[done], vals[done], ids[done]))
        pending = pending[~done]

    if len(decided) == 1:
        return decided[0][1], decided[0][2]
    width = max(v.shape[1] for _, v, _ in decided)
    weights = torch.zeros(n, width, dtype=probs.dtype, device=device)
    ids = torch.zeros(n, width, dtype=torch.long, device=device)
    for rows_, v, i in decided:
        weights[rows_, :v.shape[1]] = v
        ids[rows_, :i.shape[1]] = i
    return weights, ids


def _process(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None) -> torch.Tensor:
    """The penalties and min_tokens masking of `rows`, in place (a contiguous copy if `logits` was not)."""
    # A logit divided by a repetition penalty that is 0 in float32 is inf: saturate it (it wins the draw).
    fmax = torch.finfo(logits.dtype).max
    logits = apply_penalties(logits, rows).clamp_(-fmax, fmax)
    _mask_stop_tokens(logits, rows, eos_token_id)
    return logits


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Draw a token for each row of logits (owned: modified in place); returns ids [len(rows)]."""
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    for idx, weights, ids in _weights(logits, rows):
        pos = _draw(weights, [rows[j].generator for j in idx])
        _put(tokens, idx, pos if ids is None else ids.gather(1, pos[:, None]).squeeze(1))
    return tokens


def _weights(logits: torch.Tensor, rows: list[SamplingRow]
             ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """What each row of logits (owned: modified in place) is drawn from, after temperature, top-k, top-p and
    min-p: (row indices, unnormalised weights, their token ids or None where the weights cover the vocabulary)."""
    vocab = logits.shape[1]
    temperature = _dev([r.params.temperature for r in rows], logits.device, logits.dtype)
    # The row's maximum is subtracted before dividing by the temperature, so that no logit can overflow to
    # +inf (and inf - inf to NaN): the most likely token gets 0, every other one a finite or -inf value.
    logits.sub_(logits.amax(-1, keepdim=True)).div_(temperature[:, None])
    truncated, plain = [], []
    for j, r in enumerate(rows):
        p = r.params
        (truncated if 0 < p.top_k < vocab or p.top_p < 1 else plain).append(j)
    out = []
    if plain:
        # Weights relative to the most likely token (its logit is 0 now), so min-p is a plain threshold on them.
        w = _take(logits, plain).exp_()
        if any(rows[j].params.min_p > 0 for j in plain):
            min_p = _dev([rows[j].params.min_p for j in plain], w.device, w.dtype)
            w.masked_fill_(w < min_p[:, None], 0)
        out.append((plain, w, None))
    if truncated:
        out.append((truncated, *truncate(_take(logits, truncated).softmax(-1), [rows[j].params for j in truncated])))
    return out


def probabilities(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None = None) -> torch.Tensor:
    """The distribution `sample` draws each row's token from, [len(rows), vocab] float32, rows summing to 1:
    penalties and min_tokens masking, then argmax (one-hot) for greedy rows or temperature, top-k, top-p and
    min-p. Rows must be finite (the caller checks). The logits are not modified."""
    logits = logits.float().clone()
    if any(_penalized(r.params) or r.num_output_tokens < r.params.min_tokens for r in rows):
        logits = _process(logits, rows, eos_token_id)
    probs = torch.zeros_like(logits)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        g = _dev(greedy, logits.device)
        probs[g, logits[g].argmax(-1)] = 1.0
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        for idx, weights, ids in _weights(_take(logits, sampled), [rows[i] for i in sampled]):
            at = _dev([sampled[j] for j in idx], logits.device)
            weights = weights / weights.sum(-1, keepdim=True)
            if ids is None:
                probs[at] = weights
            else:  # rows decided at a narrower width are padded with id 0 and weight 0: add, never overwrite
                probs[at] = torch.zeros(len(idx), logits.shape[1], dtype=probs.dtype,
                                        device=probs.device).scatter_add_(1, ids, weights)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of probabilities [rows, vocab] (not modified), seeded rows from their generators."""
    return _draw(probs.clone(), generators).tolist()


def rejection_sample(target: torch.Tensor, proposal: torch.Tensor, draft: list[int],
                     generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative sampling's rule (Leviathan et al., Chen et al.): proposed token draft[j], drawn from
    proposal[j], is accepted with probability min(1, target[j][d] / proposal[j][d]); at the first rejection a token is
    drawn from the normalised residual max(0, target[j] - proposal[j]) and the rest dropped; if every one is
    accepted, a last token is drawn from target[k]. target: [k + 1, vocab], proposal: [k, vocab]. Returns the tokens
    to append (1..k + 1) and how many proposed ones were accepted; each has the target's distribution."""
    k = len(draft)
    d = torch.tensor(draft, device=target.device)
    p, q = target[:k].gather(1, d[:, None]).squeeze(1), proposal[:k].gather(1, d[:, None]).squeeze(1)
    u = torch.rand(k, generator=generator, dtype=p.dtype, device="cpu" if generator is None else generator.device)
    ok = (u.to(p.device) * q < p).tolist()  # u < p / q, without dividing by a q that rounds to 0
    accepted = ok.index(False) if False in ok else k
    if accepted == k:
        return draft + draw(target[k:], [generator]), k
    residual = (target[accepted] - proposal[accepted]).clamp_(min=0)
    if not float(residual.sum()) > 0:  # target equals proposal here (a rejection is then a rounding's)
        residual = target[accepted].clone()
    return draft[:accepted] + draw(residual[None], [generator]), accepted


def _draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Index of one draw per row from non-negative weights [rows, n] (consumed); [rows]."""
    cum = weights.cumsum_(-1)
    total = cum[:, -1:]
    # The uniform numbers are drawn on the host (seeded rows from their CPU generators) and sent in one copy.
    u = torch.empty(total.shape, dtype=total.dtype)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        _put(u, unseeded, torch.rand(len(unseeded), 1, dtype=u.dtype))
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = _uniform(g, u.dtype)
    u = u.to(total.device, non_blocking=True)
    # u * total can round up to total, which no entry of cum exceeds.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # The first entry above target: zero-weight tokens add nothing to cum, so they never are.
    return torch.searchsorted(cum, target, right=True).squeeze(1)


def _uniform(generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """The one number a seeded row draws from its generator (on the host)."""
    return torch.rand(1, generator=generator, dtype=dtype, device=generator.device).cpu()


def skip_draws(generator: torch.Generator, state: torch.Tensor, draws: int, dtype: torch.dtype = torch.float32
               ) -> None:
    """Put `generator` back to `state` and past `draws` sampled rows' numbers, as if only those rows had been
    drawn (speculative decoding: the rows after the first rejected proposal are discarded, so a seeded request's
    later tokens are those plain decoding draws)."""
    generator.set_state(state)
    for _ in range(draws):
        _uniform(generator, dtype)


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None) -> None:
    """Forbid EOS and stop_token_ids in rows that have not yet produced min_tokens tokens."""
    vocab = logits.shape[1]
    pos = []
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens:
            stops = r.params.stop_token_ids + ([] if eos_token_id is None else [eos_token_id])
            pos.extend(i * vocab + t for t in stops if 0 <= t < vocab)
    if pos:
        logits.view(-1)[_dev(pos, logits.device)] = float("-inf")


def _positions(rows: list[int], tokens: list[list[int]], vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions (row * vocab + token) of tokens[j] in rows[j], and j for each."""
    lengths = [len(t) for t in tokens]
    total = sum(lengths)
    if not total:
        return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device)
    # array() walks the lists in C: several times faster than torch.tensor on a list of ints. Checked on the host,
    # before the copy, so that the device is not waited on.
    flat = torch.frombuffer(array.array("q", itertools.chain.from_iterable(tokens)), dtype=torch.long)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got {int(flat.min())}..{int(flat.max())}")
    owner = torch.arange(len(tokens), device=device).repeat_interleave(_dev(lengths, device), output_size=total)
    return _dev(rows, device)[owner] * vocab + flat.to(device, non_blocking=True), owner


def logprob_dicts(logits: torch.Tensor, tokens: list[int], count: int,
                  ranks: list[int] | None = None) -> list[dict[int, float]]:
    """Per row of raw logits: {tokens[i]: its logprob, and the `count` most likely ids: theirs} (vLLM's logprobs,
    of the model's distribution). `ranks`, where given, is extended by each token's rank in its row: 1 + how many
    ids are strictly more likely (vLLM's)."""
    logprobs = logits.float().log_softmax(-1)
    ids = torch.tensor(tokens, device=logits.device)
    if ranks is not None:
        ranks.extend(((logprobs > logprobs.gather(1, ids[:, None])).sum(-1) + 1).tolist())
    return _logprob_dicts(logprobs, ids, [count] * len(tokens))


def _logprob_dicts(logprobs: torch.Tensor, sampled: torch.Tensor, counts: list[int]) -> list[dict[int, float]]:
    sampled_lp = logprobs.gather(1, sampled[:, None]).squeeze(1).tolist()
    top_lp, top_ids = logprobs.topk(max(counts), -1) if max(counts) else (None, None)
    out = []
    for j, (tok, lp, k) in enumerate(zip(sampled.tolist(), sampled_lp, counts)):
        d = {tok: lp}
        if k:
            d.update(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist()))
        out.append(d)
    return out


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx] for a sorted list of row indices; x itself (no copy) when idx is every row."""
    return x if len(idx) == x.shape[0] else x[_dev(idx, x.device)]


def _put(x: torch.Tensor, idx: list[int], value: torch.Tensor) -> None:
    if value is not x:
        if len(idx) == x.shape[0]:
            x.copy_(value)
        else:
            x[_dev(idx, x.device)] = value


def _dev(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list on `device` without making the host wait for the device's queue (a plain torch.tensor(...,
    device="cuda") copies synchronously, which waits for the forward still running)."""
    t = torch.tensor(values, dtype=dtype)
    return t if t.device == device else t.to(device, non_blocking=True)
