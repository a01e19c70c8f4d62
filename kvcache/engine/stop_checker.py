"""When a sequence stops: EOS, stop token ids, stop strings (found in the detokenized text), length."""
from __future__ import annotations

from kvcache.engine.sequence import Sequence


class StopChecker:
    """Decides, after each new token, whether a sequence is done and why ("stop" or "length")."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def detokenize(self, seq: Sequence) -> str:
        """The sequence's output text so far, decoded incrementally as vLLM does: only the tokens since the last
        clean point are decoded, twice (without and with the new ones, from the same context token, so a decoder
        that strips a leading space strips it from both), and the difference is appended once it no longer ends
        in U+FFFD (a character whose bytes have not all arrived). The cost per call is a few tokens', not the
        whole output's (a 1,024-token output cost 0.3 ms a decode, 4,096 tokens 1.7 ms, at every step of a
        streamed or stop-string request). The text returned equals decoding every output token at once
        (trailing U+FFFD included). No clean-up of tokenization spaces: it rewrites earlier text as tokens
        arrive, and streamed text must be a prefix of the final text (vLLM's does not clean up either)."""
        start, end = seq.num_prompt_tokens, seq.num_tokens
        prefix, read, confirmed = seq.detok
        if end - start < read:  # the output shrank (nothing does this today): decode it afresh
            prefix, read, confirmed = 0, 0, ""

        def decode(a: int, b: int) -> str:
            return self.tokenizer.decode(seq.token_ids[start + a:start + b],
                                         skip_special_tokens=seq.params.skip_special_tokens,
                                         clean_up_tokenization_spaces=False) if b > a else ""
        before, after = decode(prefix, read), decode(prefix, end - start)
        new = after[len(before):]
        if new and not new.endswith("\ufffd"):
            seq.detok = (read, end - start, confirmed + new)
        return confirmed + new

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` stops after appending `token`, or None. A stop string cuts `seq.text` where it starts and
        becomes `seq.stop_reason`, as does a stop token id."""
        p = seq.params
        searched = 0
        if p.stop:
            searched = len(seq.text)  # the text before this token has been searched already
            seq.text = self.detokenize(seq)
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop:
                # A new match ends in the new text, so it starts at most len(stop) - 1 characters before it.
                start = max(0, min(searched, len(seq.text)) - max(len(s) for s in p.stop) + 1)
                found = [(at, s) for s in p.stop if (at := seq.text.find(s, start)) >= 0]
                if found:
                    at, s = min(found)
                    seq.text = seq.text[:at]
                    seq.stop_reason = s
                    return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
