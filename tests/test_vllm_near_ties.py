"""The bfloat16 comparison of two engines' greedy outputs (tests/vllm_engine.py), on hand-made outputs: it
must accept a flipped near-tie and refuse a token the other engine did not rank (no vLLM needed)."""

from vllm_engine import first_divergences_are_near_ties


def out(tokens, tops):
    return (list(tokens), [set(t) for t in tops])


def test_equal_outputs_pass():
    a = [out([1, 2, 3], [{1, 9}, {2, 9}, {3, 9}])]
    assert first_divergences_are_near_ties(a, a) == []


def test_a_flipped_near_tie_passes_and_what_follows_it_is_not_compared():
    a = [out([1, 2, 3, 4], [{1}, {2, 7}, {3}, {4}])]
    b = [out([1, 7, 5, 6], [{1}, {7, 2}, {5}, {6}])]  # 2 and 7 tied at position 1; the texts then part
    assert first_divergences_are_near_ties(a, b) == []


def test_a_token_the_other_engine_did_not_rank_fails():
    a = [out([1, 2], [{1}, {2, 7}]), out([5, 6], [{5}, {6}])]
    b = [out([1, 2], [{1}, {2}]), out([5, 8], [{5}, {8, 6}])]  # row 1: 6 is in b's top, 8 is not in a's
    problems = first_divergences_are_near_ties(a, b)
    assert len(problems) == 1 and problems[0].startswith("sequence 1, token 1: 6")


def test_different_lengths_fail():
    assert first_divergences_are_near_ties([out([1, 2], [{1}, {2}])], [out([1], [{1}])]) == ["sequence 0: 2 tokens against 1"]
