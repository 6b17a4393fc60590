"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of tokens so a multi-byte character split across tokens is
never emitted broken (a trailing U+FFFD means "wait for the next token"). Stop strings may span
tokens: the last `max(len(stop)) - 1` characters are held back from the stream until they can no
longer begin a stop string, so nothing is emitted that a stop would later cut.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
PREFIX_WINDOW = 6  # tokens of context re-decoded in front of the new ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.tokens = list(prompt_token_ids[-PREFIX_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all output text decoded so far (stop-trimmed once stopped)
        self.emitted = 0  # characters of `text` already handed out
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special)

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append tokens; returns the stop string matched (text trimmed), else None."""
        if self.tokenizer is None:
            return None
        for t in token_ids:
            self.tokens.append(t)
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
                continue  # incomplete character (or nothing printable yet)
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            start = max(0, len(self.text) - self.hold)
            self.text += new
            stop = self._find_stop(start)
            if stop is not None:
                return stop
        return None

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.hold = 0
        return s

    def flush(self) -> None:
        """Finishing: release the held-back tail."""
        self.hold = 0

    def take_delta(self) -> str:
        """New text that can be shown now."""
        end = max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
