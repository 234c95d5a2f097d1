"""StopMatcher: the same text cut at every boundary gives the same output."""

from hypothesis import given, strategies as st

from mlx_server.text.stop import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.finish()
    return out, m.stopped


def reference(stops, text):
    """The stop that is complete first (the longest on a tie) cuts the text."""
    for end in range(len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end - len(s)], s
    return text, None


def every_split(text):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


def test_stop_string_is_cut_and_never_emitted():
    assert run(["STOP"], ["Hello ST", "OP world"]) == ("Hello ", "STOP")


def test_no_stop_passes_everything_through():
    assert run([], ["a", "b"]) == ("ab", None)


def test_held_prefix_is_released_when_it_stops_matching():
    m = StopMatcher(["</end>"])
    assert m.feed("x </e") == "x "
    assert m.feed("nd") == ""
    assert m.feed("!") == "</end!"


def test_held_prefix_is_flushed_at_finish():
    m = StopMatcher(["###"])
    assert m.feed("a##") == "a"
    assert m.finish() == "##"


def test_the_stop_complete_first_wins():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", "lo w")
    assert run(["abcd", "c"], ["abcd"]) == ("ab", "c")


def test_nothing_after_stop():
    m = StopMatcher(["x"])
    assert m.feed("axb") == "a"
    assert m.feed("more") == ""
    assert m.finish() == ""


def test_every_three_way_cut_of_a_text():
    text = "The answer is 42.\n\nUser: more"
    stops = ["\n\nUser:", "42!", "swer is"]
    expected = reference(stops, text)
    for pieces in every_split(text):
        assert run(stops, pieces) == expected, pieces


@given(
    text=st.text(alphabet="ab\n<>", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n<>", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6),
)
def test_property_any_chunking_matches_reference(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(stops, pieces) == reference(stops, text)
