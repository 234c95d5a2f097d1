"""ReasoningSplitter: `<think>` blocks split from content, whatever the chunking."""

from hypothesis import given, strategies as st

from mlx_server.text.reasoning import ReasoningSplitter

START, END = "<think>", "</think>"


def run(pieces, inside=False):
    s = ReasoningSplitter(START, END, inside=inside)
    content = reasoning = ""
    for p in pieces:
        c, r = s.feed(p)
        content, reasoning = content + c, reasoning + r
    c, r = s.finish()
    return content + c, reasoning + r


def reference(text, inside=False):
    """One block: text before its opening tag and after its closing tag is content; the block is stripped."""
    content = ""
    if not inside:
        i = text.find(START)
        if i < 0:
            return text, ""
        content, text = text[:i], text[i + len(START):]
    j = text.find(END)
    if j < 0:
        return content, text.strip()
    return content + text[j + len(END):].lstrip(), text[:j].strip()


def every_split(text):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


def test_think_block_becomes_reasoning():
    assert run(["<think>\nLet me see.\n</think>\n\nParis."]) == ("Paris.", "Let me see.")


def test_output_that_starts_inside_reasoning_needs_only_the_closing_tag():
    assert run(["I think.\n</think>\n\nParis."], inside=True) == ("Paris.", "I think.")


def test_text_before_the_tag_is_kept_as_content():
    assert run(["Hello <think>hm</think> world"]) == ("Hello world", "hm")


def test_no_tag_is_all_content():
    assert run(["just an answer\n"]) == ("just an answer\n", "")


def test_unclosed_block_is_all_reasoning():
    assert run(["<think>still thinking  "]) == ("", "still thinking")


def test_second_think_tag_after_the_block_is_content():
    assert run(["<think>a</think>b<think>c</think>"]) == ("b<think>c</think>", "a")


def test_partial_tag_is_never_leaked():
    s = ReasoningSplitter(START, END)
    assert s.feed("Hi <thi") == ("Hi ", "")
    assert s.feed("nk>x</thi") == ("", "x")
    assert s.feed("nk>y") == ("y", "")


def test_partial_tag_that_is_not_a_tag_is_released():
    s = ReasoningSplitter(START, END)
    assert s.feed("a <th") == ("a ", "")
    assert s.finish() == ("<th", "")


def test_every_three_way_cut_gives_the_same_split():
    for text, inside in [
        ("<think>\nstep 1\n\nstep 2 \n</think>\n\nThe answer.", False),
        ("pre <think> x </think> post </think>", False),
        ("reason </thi nk> more\n</think>\nanswer", True),
        ("<think> never closed </", False),
    ]:
        expected = reference(text, inside)
        for pieces in every_split(text):
            assert run(pieces, inside) == expected, pieces


@given(
    text=st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "t", "k>", " ", "\n", "a"]), max_size=20).map("".join),
    inside=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6),
)
def test_property_any_chunking_matches_reference(text, inside, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(pieces, inside) == reference(text, inside)
