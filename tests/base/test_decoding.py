"""What nvpair takes for a number written by someone else: ASCII digits, and nothing int()
would refuse."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from nvpair.base.decoding import is_digits


@given(st.text())
@example("²")  # str.isdigit takes it; int refuses it (found in /proc parsing by hypothesis)
@example("٣")  # a decimal digit of another script: int takes it, a header or /proc never has it
@example("")
def test_digits_are_ascii_and_always_an_int(text: str) -> None:
    if is_digits(text):
        assert int(text) >= 0 and text.isascii() and text.strip() == text
    else:
        assert not text or any(c not in "0123456789" for c in text)
