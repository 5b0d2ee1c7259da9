"""One choice's text as tokens arrive: detokenized, cut at a stop string, released in pieces safe to send.

The text is always the decode of every output token so far (``skip_special_tokens``, as ``moetide generate``
decodes), so the pieces a stream sends concatenate to exactly the text a non-streaming answer returns. A piece is
held back while it ends in an incomplete UTF-8 character (the decoder's U+FFFD, which the next token may turn into
a real character) or could be the start of a stop string (vLLM holds back the longest stop string's length less
one, as here). A stop string ends the request: the text is cut before it (vLLM's default,
``include_stop_str_in_output`` false) and the caller aborts the engine request.
"""

from __future__ import annotations


class ChoiceText:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` already released
        self.stopped_by: str | None = None  # the stop string that ended it

    def add(self, token_ids: list[int], final: bool) -> str:
        """Take new tokens; return the next piece of text to send (may be empty)."""
        if self.stopped_by is not None:
            return ""
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        start = max(self.sent - self.hold, 0)
        for stop in self.stop:
            at = text.find(stop, start)
            if at != -1 and (self.stopped_by is None or at < len(self.text)):
                self.stopped_by, self.text = stop, text[:at]
        if self.stopped_by is None:
            self.text = text
        end = len(self.text)
        if not final and self.stopped_by is None:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def rest(self) -> str:
        """Whatever was held back, at the end."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece
