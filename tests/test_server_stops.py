"""StopStrings: stop strings matched across deltas; what is emitted is always a prefix of the final answer, so no
part of a stop string ever goes out, and everything before it does."""

import random

import pytest

from pinfer_llm.runtime.generation.stop_strings import StopStrings


def run(stops, deltas):
    """Feed deltas; return what was emitted after each push, whether it stopped, and the flushed tail."""
    s = StopStrings(stops)
    emitted = []
    for d in deltas:
        emitted.append(s.push(d))
        if s.stopped:
            return emitted, True
    emitted.append(s.flush())
    return emitted, False


def expected(text, stops):
    """Cut at the stop string that completes first (ends earliest); of two ending together, the longer."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return (text[:min(hits)[1]], True) if hits else (text, False)


@pytest.mark.parametrize("stops, deltas, out, stopped", [
    (["END"], ["abc", "E", "N", "D", "xyz"], "abc", True),      # stop string spread over three deltas
    (["END"], ["abcE", "NDxyz"], "abc", True),                   # ...over two, each with other text
    (["END"], ["abcEN", "Q"], "abcENQ", False),                  # a false start is released once it cannot match
    (["END"], ["abcEN"], "abcEN", False),                        # ...or at the end of generation
    (["\n\n", "User:"], ["hi\n", "User", ": x"], "hi\n", True),  # the earlier of two stops wins
    (["ab", "b"], ["xab"], "x", True),                           # both complete in one delta: the longer wins
    (["abc", "b"], ["xabc"], "xa", True),                        # "b" completes first, split or not
    (["abc", "b"], ["xa", "b", "c"], "xa", True),
    (["aab"], ["a", "a", "a", "b"], "a", True),                  # overlapping partial matches
    ([], ["no", " stops"], "no stops", False),
    (["x"], ["", "x"], "", True),
])
def test_cases(stops, deltas, out, stopped):
    emitted, did = run(stops, deltas)
    assert "".join(emitted) == out and did == stopped


def test_holds_back_only_what_could_still_match():
    s = StopStrings(["STOP"])
    assert s.push("abcST") == "abc"   # "ST" may begin "STOP"
    assert s.push("O") == ""
    assert s.push("x") == "STOx"      # it did not
    assert s.push("S") == ""
    assert s.push("TOP and more") == "" and s.stopped


def test_random_texts_and_splits():
    rng = random.Random(0)
    alphabet = "ab\nc"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 8))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)], strict=True)]
        emitted, did = run(stops, deltas)
        want, want_stop = expected(text, stops)
        assert ("".join(emitted), did) == (want, want_stop), (text, stops, deltas)
        sent = ""
        for e in emitted:  # streamed: every moment's output is a prefix of the answer, nothing is taken back
            sent += e
            assert want.startswith(sent)
