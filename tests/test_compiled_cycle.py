"""Compiled cycles (mx.compile, the default on a GPU) run here on the CPU:
the same tokens as the target alone, traces kept across calls and prompt
caches, the seed an input of the trace, and new weights never meeting an
old trace."""

import mlx.core as mx
import pytest
from test_sampling import plain_sampled
from tiny import greedy_reference, make_tokenizer

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.traces import traces_for
from dflash_mlx.targets import adapt


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setattr(Cycle, "compile_graphs", True)


def tokens(model, draft, prompt, **kw):
    return [t for r in stream_generate(model, draft, make_tokenizer(24), prompt, **kw) for t in r.tokens]


def test_compiled_greedy_equals_target_across_calls_and_caches(compiled, agreeing_pair):
    model, draft = agreeing_pair
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [9] * 40]
    first = traces_for(adapt(model), draft)
    for block in (4, 16, "auto"):
        for prompt in prompts:
            cache = make_prompt_cache(model, draft)
            want = greedy_reference(model, prompt, 40)
            assert tokens(model, draft, prompt, max_tokens=40, block_size=block, prompt_cache=cache) == want, block
            # a second turn on the same cache replays the traces
            more = prompt + want + [5, 6]
            got = tokens(model, draft, more, max_tokens=24, block_size=block, prompt_cache=cache)
            assert got == greedy_reference(model, more, 24), block
    kept = traces_for(adapt(model), draft)
    assert kept is first and {k[0] for k in kept.compiled} >= {4, 16}


def test_seed_is_an_input_of_the_trace(compiled, agreeing_pair):
    """One trace serves every seed: each call's text is the target's own
    sample with that call's noise (a seed baked into the trace would repeat
    the first call's text)."""
    model, draft = agreeing_pair
    prompt = [3, 1, 4, 1, 5]
    texts = []
    for seed in (0, 1, 2):
        got = tokens(model, draft, prompt, max_tokens=30, temperature=0.8, seed=seed, block_size=8)
        assert got == plain_sampled(model, prompt, 30, seed, 0.8, 1.0, 0), seed
        texts.append(got)
    assert len({tuple(t) for t in texts}) > 1
    keys = [k for k in traces_for(adapt(model), draft).compiled if k[0] == 8 and k[2]]  # block 8, seeded
    assert len(keys) == 1  # one sampled trace for block 8, replayed for each seed


def test_new_weights_start_new_traces(compiled):
    """Compiled graphs hold weights as constants: after the target's weights
    change, output follows the new weights."""
    from tiny import draft_config, lean_towards_one_token, make_draft, make_target, random_draft_weights, target_config

    tcfg = target_config("qwen3", vocab=24, layers=3)
    model = lean_towards_one_token(make_target(tcfg, seed=31), 0.36)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=32))
    prompt = [1, 2, 3, 4]
    assert tokens(model, draft, prompt, max_tokens=24, block_size=8) == greedy_reference(model, prompt, 24)
    before = traces_for(adapt(model), draft)
    head = model.lm_head
    head.weight = head.weight[::-1]  # a different head: different text
    mx.eval(head.weight)
    want = greedy_reference(model, prompt, 24)
    assert tokens(model, draft, prompt, max_tokens=24, block_size=8) == want
    assert traces_for(adapt(model), draft) is not before


def test_kept_traces_do_not_hold_a_calls_cache(compiled, agreeing_pair):
    """The traces outlive the call; the prompt cache it used does not."""
    import gc
    import weakref

    model, draft = agreeing_pair
    cache = make_prompt_cache(model, draft)
    tokens(model, draft, [3, 1, 4], max_tokens=12, block_size=4, prompt_cache=cache)
    assert not traces_for(adapt(model), draft).now
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None


def small_pair(seed: int):
    """A 3-layer qwen3 target, its mlx-lm config and a 1-layer drafter."""
    from tiny import draft_config, make_draft, make_target, random_draft_weights, target_config

    tcfg = target_config("qwen3", vocab=24, layers=3, hidden=64)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 2])
    return tcfg, make_target(tcfg, seed=seed), make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1))


@pytest.mark.parametrize("compile_graphs", [True, False])
def test_an_adapter_kept_across_new_weights_runs_the_new_ones(compile_graphs, monkeypatch):
    """``adapt`` returns an adapter it is given; after the model is quantized
    under it, its fused layers follow the new weights (they used to keep
    the old bf16 products)."""
    monkeypatch.setattr(Cycle, "compile_graphs", compile_graphs)
    _, model, draft = small_pair(41)
    target = adapt(model)
    prompt = [1, 2, 3, 4]
    assert tokens(target, draft, prompt, max_tokens=20, block_size=4) == greedy_reference(model, prompt, 20)
    import mlx.nn as nn

    nn.quantize(model, group_size=32, bits=4)
    want = greedy_reference(model, prompt, 20)
    assert tokens(target, draft, prompt, max_tokens=20, block_size=4) == want


def test_a_prompt_caches_adapter_serves_its_calls(agreeing_pair, monkeypatch):
    """Calls on a prompt cache run the adapter it was made with: none is
    built per call (a server's request paid for one, and its pool's new
    caches for more)."""
    from dflash_mlx.targets import DenseTarget

    model, draft = agreeing_pair
    cache = make_prompt_cache(model, draft)
    built = []
    init = DenseTarget.__init__
    monkeypatch.setattr(DenseTarget, "__init__", lambda self, m: (built.append(m), init(self, m))[1])
    prompt = [3, 1, 4, 1, 5]
    for more in ([], [2, 6], [5]):
        prompt = prompt + more
        assert tokens(model, draft, prompt, max_tokens=12, block_size=4, prompt_cache=cache) == greedy_reference(
            model, prompt, 12
        )
        prompt = prompt + greedy_reference(model, prompt, 12)
    assert built == []
    assert tokens(model, draft, [3, 1, 4], max_tokens=4, block_size=4) == greedy_reference(model, [3, 1, 4], 4)
    assert len(built) == 1  # without a cache, the call adapts the model itself


@pytest.mark.parametrize("compile_graphs", [True, False])
def test_a_prompt_caches_adapter_follows_new_weights(compile_graphs, monkeypatch):
    """The model quantized after its prompt cache was made: the cache's
    adapter, serving a later call, runs the new weights."""
    import mlx.nn as nn

    monkeypatch.setattr(Cycle, "compile_graphs", compile_graphs)
    _, model, draft = small_pair(47)
    cache = make_prompt_cache(model, draft)
    assert tokens(model, draft, [1, 2, 3, 4], max_tokens=12, block_size=4, prompt_cache=cache) == greedy_reference(
        model, [1, 2, 3, 4], 12
    )
    nn.quantize(model, group_size=32, bits=4)
    prompt = [5, 6, 7, 8, 9]  # nothing cached: every position read with the new weights
    want = greedy_reference(model, prompt, 20)
    assert tokens(model, draft, prompt, max_tokens=20, block_size=4, prompt_cache=cache) == want


@pytest.mark.parametrize("compile_graphs", [True, False])
def test_weights_changed_before_the_first_call_are_the_ones_that_run(compile_graphs, monkeypatch):
    """New weights (a cast, ``model.set_dtype`` after ``load``) between
    making the adapter and its first decode: its fused layers, made with
    the adapter, follow them (they used to keep the old products until a
    second pair of weights came)."""
    from tiny import make_target

    monkeypatch.setattr(Cycle, "compile_graphs", compile_graphs)
    tcfg, model, draft = small_pair(43)
    target = adapt(model)
    model.update(make_target(tcfg, seed=45).parameters())
    prompt = [1, 2, 3, 4]
    assert tokens(target, draft, prompt, max_tokens=20, block_size=4) == greedy_reference(model, prompt, 20)


def test_kept_traces_are_bounded(compiled, agreeing_pair, monkeypatch):
    """A server meeting many sampling settings keeps the latest few."""
    from dflash_mlx.decode.traces import Traces

    model, draft = agreeing_pair
    monkeypatch.setattr(Traces, "most_settings", 2)
    for temperature in (0.5, 0.6, 0.7):
        tokens(model, draft, [3, 1, 4], max_tokens=8, temperature=temperature, seed=0, block_size=4)
    kept = traces_for(adapt(model), draft).compiled
    assert [k[1].temperature for k in kept] == [0.6, 0.7]


@pytest.mark.parametrize("lookup", [False, True])
def test_a_cycle_counts_as_built_exactly_when_it_traced(compiled, monkeypatch, lookup):
    """``auto`` leaves a cycle's time out of its size's cost when its launch
    built graphs. A compiled cycle traces where its buffers' widths are new to
    it; the drafter's host bound runs a queued cycle ahead of the launch's, so
    a guess from it flagged cycles that traced nothing and missed the one that
    traced, whose trace was then timed as the size's cost, and told the
    chooser so beforehand."""
    from tiny import draft_config, make_draft, make_target, random_draft_weights, target_config

    tcfg = target_config("qwen3", vocab=256, layers=4)
    model = make_target(tcfg, seed=3)  # a drafter that is seldom right: a cycle commits about one token
    dcfg = draft_config(tcfg, layers=1, block_size=16, taps=[0, 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=4))
    traced, compile = [], mx.compile

    def counting(fn):
        def step(*args):
            traced.append(True)
            return fn(*args)

        return compile(step)

    monkeypatch.setattr(mx, "compile", counting)
    seen, launch = [], Cycle.launch

    def spy(self, size, *args, **kw):
        before, forecast = len(traced), self.would_build(size, args[2])  # (last, length, bound)
        flight = launch(self, size, *args, **kw)
        if size > 1:
            seen.append((len(traced) > before, flight.new_shape, forecast))
        return flight

    monkeypatch.setattr(Cycle, "launch", spy)
    cache = make_prompt_cache(model, draft)
    prompt = [(7 * i) % 251 + 1 for i in range(700)]
    got = tokens(model, draft, prompt, max_tokens=64, block_size=16, prompt_cache=cache, lookup=lookup)  # across 768
    assert got == greedy_reference(model, prompt, 64)
    # flagged when it traced, and foretold as the chooser asks before choosing
    assert any(t for t, *_ in seen) and all(t == flagged == foretold for t, flagged, foretold in seen), seen
