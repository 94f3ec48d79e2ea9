"""The prompt sets: held-out sets never overlap the training prompts; each set is what its docstring says."""

from __future__ import annotations

import re

import pytest

from fspec.train import prompts as P


def test_held_out_sets_have_their_documented_sizes_and_shapes():
    """HumanEval's 164 stubs (as requests), TruthfulQA's 817 questions, and the health questions."""
    code, chat, health = (P.heldout(n) for n in P.HELDOUT)
    assert len(code) == 164 and all(p.startswith("Complete the following Python function.") for p in code)
    assert "def has_close_elements" in code[0]
    assert len(chat) == 817 and chat[0].endswith("?")
    assert len(health) > 500


def test_training_prompts_never_overlap_a_held_out_set():
    """No training prompt's normalised text equals a held-out prompt's or a bare HumanEval stub's."""
    train = P.train_prompts()
    assert len(train) >= 5000 and len(set(train)) == len(train)
    held = {P.normalise(p) for n in P.HELDOUT for p in P.heldout(n)}
    stubs = {P.normalise(p.split("```python\n", 1)[1].rsplit("\n```", 1)[0]) for p in P.heldout("code")}
    keys = {P.normalise(p) for p in train}
    assert not keys & held and not keys & stubs
    code = [p for p in train if "Python" in p and "`" in p]
    assert len(code) >= 2000, "the standard library's docstrings give a few thousand code requests"


# slow: three walks of the standard library (~7 s each); train_prompts itself runs in the default run
# (test_training_prompts_never_overlap_a_held_out_set, the argument checks below, the --tiny recipe)
@pytest.mark.slow
def test_training_prompts_are_a_pure_function_of_their_arguments():
    """Same seed, same list; another seed shuffles differently; counts are honoured."""
    a, b = P.train_prompts(n_code=50, n_chat=40), P.train_prompts(n_code=50, n_chat=40)
    assert a == b and len(a) == 90
    assert P.train_prompts(n_code=50, n_chat=40, seed=1) != a


# slow: four walks of the standard library; its code path (CODE_TEMPLATES sampled per function) runs with
# one phrasing in the default run
@pytest.mark.slow
def test_code_phrasings_ask_for_each_function_in_distinct_templates():
    """Two phrasings give two different requests per documented function: twice the code prompts, and every
    function named in two distinct sentences."""
    import random

    one = P.stdlib_code_prompts(random.Random(0))
    two = P.stdlib_code_prompts(random.Random(0), phrasings=2)
    # (the same docstring and signature recur across modules: distinct texts are counted, not rows)
    assert len(two) == 2 * len(one) and len(set(two)) > 1.9 * len(set(one))
    pairs = list(zip(two[::2], two[1::2]))
    assert all(a != b for a, b in pairs)
    calls = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\([^`()]*\)")  # every template names the signature
    assert all(set(calls.findall(a)) & set(calls.findall(b)) for a, b in pairs)
    stubs = [p for p in two if p.startswith("Complete the following Python function.")]
    assert stubs and all("```python\ndef " in p for p in stubs)
    more = P.train_prompts(n_code=10**5, n_chat=0, code_phrasings=2)
    assert len(more) > len(P.train_prompts(n_code=10**5, n_chat=0)) * 1.9


# slow: two walks of the standard library for a property of the draw's seeding
@pytest.mark.slow
def test_the_chat_prompts_drawn_do_not_depend_on_the_code_requests():
    """The chat draw has its own generator: the standard library's size (the interpreter's version) or the
    number of code phrasings cannot change which chat prompts are trained on."""
    chat = set(P.train_prompts(n_code=0, n_chat=200))
    with_code = set(P.train_prompts(n_code=300, n_chat=200, code_phrasings=3))
    assert chat and chat <= with_code and len(with_code - chat) == 300


@pytest.mark.parametrize(
    "kwargs", [{"n_code": -1}, {"n_chat": 1.5}, {"seed": True}, {"code_phrasings": 0}, {"code_phrasings": 6}]
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        P.train_prompts(**kwargs)


def test_unknown_held_out_set_is_a_value_error():
    with pytest.raises(ValueError, match="name: expected one of"):
        P.heldout("mt-bench")
