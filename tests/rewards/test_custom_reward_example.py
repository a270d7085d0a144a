"""examples/custom_reward/strict_boxed.py through the reward workers, as reward.function names it."""

from __future__ import annotations

from stapo_megatron.rewards import RewardConfig, RewardPool, check_reward_function

FUNCTION = "examples.custom_reward.strict_boxed:score"

CASES = [
    # (response, ground truth, row, reason, reward, detail)
    (
        "So the answer is $\\boxed{\\dfrac{1}{2}}$.",
        "\\frac{1}{2}",
        {},
        "correct",
        1.0,
        "one box, equal to the ground truth",
    ),
    ("\\boxed{ \\left( 1, 2 \\right) }", "(1,2)", {}, "correct", 1.0, "one box, equal to the ground truth"),
    ("\\boxed{x \\rightarrow 2}", "x\\to2", {}, "wrong", 0.0, "boxed 'x \\\\rightarrow 2', expected 'x\\\\to2'"),
    ("The result is \\boxed 7.", "7", {}, "correct", 1.0, "one box, equal to the ground truth"),
    ("\\boxed{0.5}", "\\frac{1}{2}", {}, "wrong", 0.0, "boxed '0.5', expected '\\\\frac{1}{2}'"),
    ("First \\boxed{3}, then \\boxed{4}.", "4", {}, "wrong", 0.0, "2 boxes, expected exactly one"),
    ("The answer is 4.", "4", {}, "wrong", 0.0, "no \\boxed{}"),
    ("\\boxed{}", "4", {}, "wrong", 0.0, "the box holds no answer (empty_answer)"),
    ("\\boxed{4", "4", {}, "wrong", 0.0, "the box holds no answer (unterminated_box)"),
    ("\\fboxsep is not a box; \\fbox{12}", "12", {}, "correct", 1.0, "one box, equal to the ground truth"),
    ("\\boxed{twelve}", "12", {"answer_aliases": ["twelve", 12]}, "correct", 1.0, "one box, equal to the ground truth"),
    ("\\boxed{twelve}", "12", {"answer_aliases": "twelve"}, "wrong", 0.0, "boxed 'twelve', expected '12'"),
]


def test_the_example_passes_the_config_time_check():
    check_reward_function(RewardConfig(kind="custom", function=FUNCTION))


def test_the_example_scores_in_the_reward_workers():
    with RewardPool(kind="custom", function=FUNCTION, num_workers=2) as pool:
        results = pool.score([c[0] for c in CASES], [c[1] for c in CASES], [c[2] for c in CASES])
        assert pool.workers_replaced == 0
    assert [(r.reason, r.reward, r.detail) for r in results] == [c[3:] for c in CASES]
