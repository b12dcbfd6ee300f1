"""Greedy decoding is mlx-lm's greedy decoding where log-probabilities tie.

mlx-lm's step takes the argmax of the log-softmax in the logits' dtype; in
bfloat16 that rounding ties tokens whose logits differ by a fraction of a
unit, and the lowest id wins. A target with flat bfloat16 logits ties at
almost every step, so DFlash's greedy text equals mlx-lm's only if its
verify picks tokens the same way."""

import mlx.core as mx
import pytest
import tiny

from dflash_mlx import stream_generate

VOCAB = 512
PROMPT = [5, 9, 14, 3, 7]


@pytest.fixture(scope="module")
def flat_pair():
    tcfg = tiny.target_config(vocab=VOCAB, layers=4)
    model = tiny.make_target(tcfg, seed=3)
    # a final norm this small leaves logits within a few tenths of each other
    model.update({"model": {"norm": {"weight": mx.full((tcfg["hidden_size"],), 0.3)}}})
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    dcfg = tiny.draft_config(tcfg, block_size=8)
    draft = tiny.make_draft(dcfg, tiny.random_draft_weights(dcfg))
    draft.set_dtype(mx.bfloat16)
    return model, draft


def test_ties_change_the_greedy_text_here(flat_pair):
    """The fixture does what it is for: along mlx-lm's greedy text, some step's
    token is not its logits' argmax."""
    model, _ = flat_pair
    text = PROMPT + tiny.greedy_reference(model, PROMPT, 24)
    logits = model(mx.array(text)[None])[0, len(PROMPT) - 1 : -1]
    assert (mx.argmax(logits, axis=-1) != mx.array(text[len(PROMPT) :])).any().item()


@pytest.mark.parametrize("block_size", [2, 4, 8, "auto"])
def test_greedy_text_equals_mlx_lm_through_ties(flat_pair, block_size):
    model, draft = flat_pair
    expected = tiny.greedy_reference(model, PROMPT, 24)
    got = [
        t
        for r in stream_generate(model, draft, tiny.make_tokenizer(VOCAB), PROMPT, max_tokens=24, block_size=block_size)
        for t in r.tokens
    ]
    assert got == expected
