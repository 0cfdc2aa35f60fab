import pickle

import pytest

from rhymerl.rewards import RewardItem, exact_score, extract_answer, last_boxed, math_verify_score, resolve_kind

pytestmark = pytest.mark.cpu


def test_extract_answer_precedence():
    assert extract_answer("think <answer>1</answer> more <answer> -42 </answer>") == "-42"
    assert extract_answer(r"so \boxed{\frac{1}{2}} hence \boxed{x^{2}}") == "x^{2}"
    assert extract_answer("steps\n\nSo the total is 1,234.\n") == "1234"
    assert extract_answer("hmm\nforty two") == "forty two"
    assert extract_answer("   ") is None
    # The final-answer line data.answer_format=step_by_step asks for, after the work.
    assert extract_answer("3 + 4 = 7\n7 + 5 = 12\nAnswer: 12") == "12"
    assert extract_answer("**Answer:** -3.\nHope this helps, 9 more") == "-3"
    assert extract_answer("Answer: 5\nchecking: 2 + 3 = 5\nanswer: \\boxed{6}") == "6"
    assert extract_answer("The answer: 5 apples\nso 8") == "8"
    assert last_boxed(r"\boxed{a{b}c") is None


@pytest.mark.parametrize(
    "gold,response,ok",
    [
        ("1/2", r"The answer is $\boxed{\frac{1}{2}}$.", True),
        ("1/2", r"Therefore \boxed{0.5}", True),
        ("0.5", r"We get \boxed{\dfrac12}", True),
        (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", False),
        ("x^2+1", r"\boxed{1 + x^2}", True),
        ("-129", "<answer>-129</answer>", True),
        ("7", "I do not know", False),
    ],
)
def test_math_verify_real(gold, response, ok):
    res = math_verify_score(RewardItem(response, gold, kind="math_verify"))
    assert res.correct is ok and res.score == float(ok)


def test_reasoning_gym_basic_arithmetic_uses_dataset_score():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=7)
    for entry in ds:
        meta = dict(entry["metadata"])
        right = RewardItem(f"Let me compute.\n<answer>{entry['answer']}</answer>", entry["answer"], metadata=meta)
        assert resolve_kind(right, "auto") == "exact"
        assert exact_score(right).score == 1.0
        # Agrees with the dataset object's own score_answer, on a wrong answer too.
        wrong_text = f"The result is {int(entry['answer']) + 1}"
        wrong = RewardItem(wrong_text, entry["answer"], metadata=meta)
        assert exact_score(wrong).score == ds.score_answer(extract_answer(wrong_text), entry) == 0.0
        # reasoning-gym's partial credit when the gold is inside a longer answer.
        padded = RewardItem(f"<answer>= {entry['answer']}</answer>", entry["answer"], metadata=meta)
        assert exact_score(padded).score == pytest.approx(ds.score_answer(f"= {entry['answer']}", entry))
        assert 0 < exact_score(padded).score < 1 and not exact_score(padded).correct


def test_plain_exact_match_normalises_numbers():
    assert exact_score(RewardItem("so it is 12.0", "12", kind="exact")).correct
    assert exact_score(RewardItem("<answer>Paris.</answer>", "Paris", kind="exact")).correct
    assert not exact_score(RewardItem("<answer>13</answer>", "12", kind="exact")).correct
    item = RewardItem("x", "y", kind="exact", metadata={"a": [1, 2]})
    assert pickle.loads(pickle.dumps(item)) == item
