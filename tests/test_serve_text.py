"""``serve.text.ChoiceText``: the pieces a stream sends concatenate to the whole text, a stop string is cut before
it even when it arrives split over tokens, and an incomplete character is held back until it completes."""

from __future__ import annotations

from moetide.serve.text import ChoiceText


class ByteTokenizer:
    """Token i is byte i; decode as UTF-8 with U+FFFD for an incomplete tail, as byte-level BPE decoders do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: ChoiceText, data: bytes) -> list[str]:
    pieces = [text.add([b], final=False) for b in data[:-1]] + [text.add([data[-1]], final=True)]
    return pieces + [text.rest()]


def test_pieces_concatenate_to_the_text_and_hold_an_incomplete_character():
    text = ChoiceText(ByteTokenizer(), [])
    data = "héllo wörld".encode()
    pieces = feed(text, data)
    assert "".join(pieces) == text.text == "héllo wörld"
    assert "\ufffd" not in "".join(pieces) and pieces[1] == ""  # the first byte of é waits for the second


def test_a_stop_string_split_over_tokens_is_cut_before_and_never_sent():
    text = ChoiceText(ByteTokenizer(), ["STOP", "xyz"])
    sent = []
    for b in b"abc STOP and more":
        sent.append(text.add([b], final=False))
        if text.stopped_by is not None:
            break
    assert text.stopped_by == "STOP" and text.text == "abc " and "".join(sent) + text.rest() == "abc "
    assert text.add([65], final=True) == ""  # nothing after a stop


def test_the_earliest_of_several_stop_strings_wins():
    text = ChoiceText(ByteTokenizer(), ["ab", "later"])
    text.add(list(b"xx later ab"), final=False)
    assert text.stopped_by == "later" and text.text == "xx "
