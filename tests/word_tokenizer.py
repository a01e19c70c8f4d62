"""A tokenizer of one token per word with a two-tag chat template, for the evaluations' prompt tests: prompts stay
readable after a round trip, and a split prompt's parts can be read back."""
from __future__ import annotations


class WordTokenizer:
    chat_template = "<user> ... <assistant>"

    def __init__(self) -> None:
        self.words: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.words:
                self.words.append(w)
            ids.append(self.words.index(w))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize and [m["role"] for m in messages] == ["user"]
        return f"<user> {messages[0]['content']} <assistant> "
