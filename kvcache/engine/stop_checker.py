"""When a sequence stops: EOS, stop token ids, stop strings (found in the detokenized text), length."""
from __future__ import annotations

from kvcache.engine.sequence import Sequence


class StopChecker:
    """Decides, after each new token, whether a sequence is done and why ("stop" or "length")."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def detokenize(self, seq: Sequence) -> str:
        """The sequence's output text. No clean-up of tokenization spaces: it rewrites earlier text as tokens
        arrive, and streamed text must be a prefix of the final text (vLLM's incremental detokenizer does not
        clean up either)."""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

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
