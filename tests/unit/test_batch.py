"""engine/batch.py: the pad-aware generator gives what mlx-lm's BatchGenerator gives, token for token,
through inserts, removes, finishes, prefix caches and per-sequence logits processors."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_server.engine.batch import PadAwareBatchGenerator, _PadAwareBatchKVCache, make_batch_generator
from mlx_server.engine.request import SamplingParams
from mlx_server.engine.sampling import greedy, make_processors

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    mx.random.seed(3)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           tie_word_embeddings=False)
    m = llama.Model(args)
    # Larger weights than the default init, so greedy tokens vary and ties are unlikely.
    m.update(tree_scale(m.parameters(), 4.0))
    mx.eval(m.parameters())
    return m


def tree_scale(tree, k):
    if isinstance(tree, dict):
        return {n: tree_scale(v, k) for n, v in tree.items()}
    if isinstance(tree, list):
        return [tree_scale(v, k) for v in tree]
    return tree * k if tree.ndim > 1 else tree


def prompt(n, start=1):
    return [(start + 7 * i) % (VOCAB - 1) + 1 for i in range(n)]


def drive(gen, script, steps=40):
    """Run `gen` for `steps` steps; `script[step]` is a callable run before that step (inserts/removes).
    Returns {name: [tokens]} and the finish reasons, where names are the script's own labels."""
    out, reasons, names = {}, {}, {}
    for step in range(steps):
        if step in script:
            script[step](gen, names)
        _, responses = gen.next()
        for r in responses:
            name = names[r.uid]
            out.setdefault(name, []).append(r.token)
            if r.finish_reason is not None:
                reasons[name] = r.finish_reason
    return out, reasons


def insert(name, tokens, max_tokens=12, processors=(), cache=None, all_tokens=None):
    def run(gen, names):
        (uid,) = gen.insert([tokens], max_tokens=[max_tokens], caches=[cache],
                            all_tokens=[all_tokens or []], samplers=[greedy], logits_processors=[list(processors)])
        names[uid] = name
        names[name] = uid
    return run


def remove(name, keep=None):
    def run(gen, names):
        caches = gen.remove([names[name]], return_prompt_caches=True)
        if keep is not None:
            keep[type(gen).__name__] = caches[names[name]]
    return run


def both(model, script, steps=40):
    plain = drive(BatchGenerator(model, stop_tokens=[]), script, steps)
    ours = drive(PadAwareBatchGenerator(model, stop_tokens=[]), script, steps)
    return plain, ours


def test_default_generator_is_the_pad_aware_one(model, monkeypatch):
    assert isinstance(make_batch_generator(model), PadAwareBatchGenerator)
    monkeypatch.setenv("MLX_SERVER_PLAIN_BATCH", "1")
    assert type(make_batch_generator(model)) is BatchGenerator


def test_one_sequence_matches_plain_generator_and_generate_step(model):
    p = prompt(23)
    plain, ours = both(model, {0: insert("a", p, max_tokens=20)})
    assert ours == plain
    assert ours[1]["a"] == "length" and len(ours[0]["a"]) == 20
    alone = [t for t, _ in zip((int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=20)), range(20))]
    assert ours[0]["a"] == alone


def test_one_sequence_decodes_without_a_mask(model):
    gen = PadAwareBatchGenerator(model, stop_tokens=[])
    gen.insert([prompt(9)], max_tokens=[5])
    gen.next()  # the prompt
    gen.next()  # the first decode step
    caches = gen._generation_batch.prompt_cache
    assert caches and all(type(c) is _PadAwareBatchKVCache for c in caches)
    assert caches[0].make_mask(1) is None
    assert caches[0].make_mask(4) == "causal"
    # Like a KVCache, the position is a plain int: no per-layer offset array to update every step.
    assert isinstance(caches[0].offset, int) and caches[0].offset == caches[0]._idx >= 9


def test_ragged_batch_with_inserts_removes_and_finishes(model):
    script = {
        0: insert("a", prompt(17, 1), max_tokens=30),
        2: insert("b", prompt(5, 2), max_tokens=8),      # shorter: left-padded next to a
        3: insert("c", prompt(11, 3), max_tokens=25),
        9: remove("a"),
        12: insert("d", prompt(31, 4), max_tokens=10),
        14: insert("e", prompt(3, 5), max_tokens=6),
    }
    plain, ours = both(model, script, steps=45)
    assert ours == plain
    assert set(ours[0]) == {"a", "b", "c", "d", "e"}


def row_offsets(c):
    """mlx-lm's per-row offsets; ours gives an int while every row has the same one."""
    return c.offset.tolist() if isinstance(c.offset, mx.array) else [c.offset] * len(c.left_padding.tolist())


def test_offsets_match_plain_generator_step_by_step(model):
    gens = {"plain": BatchGenerator(model, stop_tokens=[]), "ours": PadAwareBatchGenerator(model, stop_tokens=[])}
    names = {k: {} for k in gens}
    script = {0: insert("a", prompt(10), max_tokens=20), 2: insert("b", prompt(3), max_tokens=5),
              3: insert("c", prompt(16), max_tokens=20), 8: remove("a")}
    for step in range(22):
        seen = {}
        for k, gen in gens.items():
            if step in script:
                script[step](gen, names[k])
            gen.next()
            caches = gen._generation_batch.prompt_cache
            seen[k] = [(c._idx, c.left_padding.tolist(), row_offsets(c)) for c in caches]
        assert seen["ours"] == seen["plain"]


def test_padding_is_tracked_on_the_host_as_on_the_device(model):
    gen = PadAwareBatchGenerator(model, stop_tokens=[])
    names = {}
    insert("a", prompt(13), max_tokens=30)(gen, names)
    gen.next()
    insert("b", prompt(4), max_tokens=4)(gen, names)
    insert("c", prompt(8), max_tokens=30)(gen, names)
    padded = 0
    for _ in range(12):  # b finishes on the way: its row is filtered out
        gen.next()
        for c in gen._generation_batch.prompt_cache:
            assert c._pad == c.left_padding.tolist()
            # mlx-lm's offsets: each row's position, _idx less its left padding.
            assert row_offsets(c) == [c._idx - p for p in c.left_padding.tolist()]
            if any(c._pad):
                padded += 1
                assert isinstance(c.make_mask(1), mx.array)
            else:
                assert c.make_mask(1) is None
    assert padded
    gen.remove([names["a"]])
    gen.next()
    (c, *_) = gen._generation_batch.prompt_cache
    assert c._pad == c.left_padding.tolist() == [0] and c.make_mask(1) is None


def test_prefix_cache_and_removed_caches_match(model):
    p = prompt(20)
    # A first run leaves a cache of the prompt; a second request continues from it.
    kept = {}
    both(model, {0: insert("a", p, max_tokens=30), 6: remove("a", keep=kept)}, steps=8)
    plain_cache, plain_tokens = kept["BatchGenerator"]
    ours_cache, ours_tokens = kept["PadAwareBatchGenerator"]
    assert plain_tokens == ours_tokens
    for a, b in zip(plain_cache, ours_cache):
        assert type(b) is KVCache and a.offset == b.offset
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]).item()

    def cached(c):
        copy = KVCache()
        copy.keys, copy.values, copy.offset = mx.array(c.keys), mx.array(c.values), c.offset
        return copy

    more = plain_tokens + prompt(6, 9)
    rest = more[len(plain_tokens):]
    plain, ours = both(model, {
        0: insert("x", rest, max_tokens=10, cache=[cached(c) for c in plain_cache], all_tokens=plain_tokens),
        1: insert("y", prompt(7, 3), max_tokens=10),
    }, steps=15)
    assert ours == plain


def test_logits_processors_see_every_token(model):
    seen = {"plain": [], "ours": []}

    def recorder(key):
        def proc(tokens, logits):
            seen[key].append(tokens.tolist()[-1] if tokens.size else None)
            return logits
        return proc

    penalty = make_processors(SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={5: 3.0}))
    results = {}
    for key, cls in (("plain", BatchGenerator), ("ours", PadAwareBatchGenerator)):
        results[key] = drive(cls(model, stop_tokens=[]), {
            0: insert("a", prompt(9), max_tokens=15, processors=[*penalty, recorder(key)]),
            3: insert("b", prompt(14, 2), max_tokens=9),
        }, steps=20)
    assert results["ours"] == results["plain"]
    assert seen["ours"] == seen["plain"]
    # Each step's processor saw the token generated by the step before it.
    assert seen["ours"][1:] == results["ours"][0]["a"][: len(seen["ours"]) - 1]


def test_cache_operations_match_mlx_lm_batch_cache():
    """The same operations on a BatchKVCache and on ours leave the same keys, padding and offsets."""
    mx.random.seed(0)

    def kv(b, n):
        return mx.random.normal((b, 2, n, 8)), mx.random.normal((b, 2, n, 8))

    def same(a, b):
        assert a._idx == b._idx and a.left_padding.tolist() == b.left_padding.tolist() == b._pad
        assert row_offsets(a) == row_offsets(b)
        if a.keys is not None:
            assert mx.array_equal(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :]).item()

    def pair(pad):
        return BatchKVCache(pad), _PadAwareBatchKVCache(pad)

    def feed(a, b, rows, n):
        """The same new keys and values (rows x n positions) into both caches."""
        k, v = kv(rows, n)
        a.update_and_fetch(k, v), b.update_and_fetch(k, v)

    a, b = pair([0, 0])
    # A prefill chunk with right padding (rows of 5 and 3 tokens), then decode steps.
    for c in (a, b):
        c.prepare(lengths=[5, 3], right_padding=[0, 2])
    feed(a, b, 2, 5)
    a.finalize(), b.finalize()
    same(a, b)
    for _ in range(3):
        feed(a, b, 2, 1)
        same(a, b)
    # Another batch joins: one row, shorter.
    a2, b2 = pair([0])
    feed(a2, b2, 1, 2)
    a.extend(a2), b.extend(b2)
    same(a, b)
    feed(a, b, 3, 1)
    same(a, b)
    a.trim(2), b.trim(2)
    same(a, b)
    # The padded rows leave: no padding remains, and the position becomes a plain int.
    a.filter([0]), b.filter([0])
    same(a, b)
    assert isinstance(b.offset, int) and b.make_mask(1) is None
    feed(a, b, 1, 1)
    same(a, b)
    a.trim(1), b.trim(1)
    same(a, b)
    # A padded row joins again: offsets come back as an array, made from the host lists.
    a3, b3 = pair([0])
    feed(a3, b3, 1, 1)
    a.extend(a3), b.extend(b3)
    same(a, b)
    for _ in range(2):
        feed(a, b, 2, 1)
        same(a, b)
    assert isinstance(b.offset, mx.array) and isinstance(b.make_mask(1), mx.array)
    ea, eb = a.extract(1), b.extract(1)
    assert ea.offset == eb.offset and mx.array_equal(ea.keys, eb.keys).item()
