import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer, text: str, params: SamplingParams, prompt: str = "Say:"):
    """Feed `text`'s tokens one at a time; return the streamed deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    deltas, emitted = [], 0
    for token in tokenizer.encode(text):
        stopped = detok.update([token])
        end = detok.emittable(stopped)
        deltas.append(detok.text[emitted:end])
        emitted = end
        if stopped:
            break
    return deltas, detok


@pytest.mark.parametrize(
    "text",
    [
        " héllo wörld, naïve café",
        " 日本語のテキストです。",
        " emoji 🎉🚀 and 👩‍👩‍👧 family",
        "  leading   spaces\n\nand\ttabs",
    ],
)
def test_incremental_text_equals_full_decode_and_never_shows_replacement_chars(tokenizer, text):
    deltas, _detok = stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text))
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_removed_and_never_streamed(tokenizer):
    deltas, detok = stream(tokenizer, " one two three STOP four five", SamplingParams(stop=["STOP"]))
    assert detok.stop_reason == "STOP"
    assert detok.text == " one two three "
    assert "".join(deltas) == detok.text and "S" not in "".join(deltas)


def test_stop_string_kept_when_asked(tokenizer):
    _, detok = stream(
        tokenizer, " alpha beta gamma", SamplingParams(stop=["beta"], include_stop_str_in_output=True)
    )
    assert detok.text == " alpha beta"


def test_stop_string_spanning_tokens_and_earliest_wins(tokenizer):
    _, detok = stream(tokenizer, " the quick brown fox jumps", SamplingParams(stop=["fox", "ick bro"]))
    assert detok.stop_reason == "ick bro" and detok.text == " the qu"


def test_stop_strings_ignored_before_min_tokens(tokenizer):
    _, detok = stream(tokenizer, " a b a b a b", SamplingParams(stop=[" a"], min_tokens=3))
    assert detok.stop_reason == " a" and detok.num_output_tokens > 3


def test_text_that_could_start_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), SamplingParams(stop=["END!"]))
    detok.update(tokenizer.encode(" fine EN"))
    visible = detok.text[: detok.emittable(False)]
    assert not visible.endswith("EN") and detok.text.endswith("EN")


class CountingTokenizer:
    """ByteTokenizer that counts the token ids it is asked to decode."""

    def __init__(self) -> None:
        from tests.test_server_app import ByteTokenizer

        self.inner, self.decoded = ByteTokenizer(), 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("token", [256, 0x80], ids=["skipped special", "byte that starts no character"])
def test_tokens_that_add_no_whole_character_cost_a_bounded_decode_each(token):
    """A long run of tokens adding no text (or only an incomplete character) costs O(1) decoding each, not
    a decode of the whole run so far each: O(L) over the sequence, not O(L^2)."""
    tok = CountingTokenizer()
    detok = IncrementalDetokenizer(tok, list(b"Say:"), SamplingParams())
    run = 2000
    for _ in range(run):
        detok.update([token])
    detok.update(list(b" done"))
    assert tok.decoded < 40 * (run + 5), tok.decoded
    assert detok.text.endswith(" done")
    if token == 0x80:  # bytes that never complete a character come out as U+FFFD, as a whole decode shows
        assert detok.text == "\ufffd" * run + " done"
    else:
        assert detok.text == " done"
