"""The math reward through the worker pool: answer styles, timeouts, dead workers, the exact reward."""

import functools
import time

import pytest
from answer_pairs import ANSWER_PAIRS, boxed_response
from code_eval_trap import fail_to_start, install_hang_and_crash

from stapo_megatron.rewards import RewardConfig, RewardPool, summarize_reasons


def test_answer_pairs_get_their_rewards(math_pool):
    assert len(ANSWER_PAIRS) >= 60
    assert sum(1 for *_, r in ANSWER_PAIRS if r == 0.0) >= 20
    responses = [boxed_response(answer) for answer, _, _ in ANSWER_PAIRS]
    results = math_pool.score(responses, [gold for _, gold, _ in ANSWER_PAIRS])
    wrong = [
        (answer, gold, expected, result.reason)
        for (answer, gold, expected), result in zip(ANSWER_PAIRS, results)
        if result.reward != expected
    ]
    assert wrong == []
    for (answer, _, _), result in zip(ANSWER_PAIRS, results):
        assert result.extracted == answer
        assert result.reason in ("correct", "wrong")


def test_fbox_and_brace_less_boxes(math_pool):
    results = math_pool.score(
        ["so \\fbox{\\frac{1}{2}}", "thus $\\boxed 12$.", "\\boxed 7.", "\\boxed{3} no: \\boxed 4"],
        ["0.5", "12", "8", "4"],
    )
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 1.0]


def test_rejections_before_verification(math_pool):
    results = math_pool.score(
        ["no box at all", "\\boxed{5", "\\boxed{}", "\\boxed{" + "1" * 2000 + "}", "\\boxed{7} and \\boxed{"],
        ["5", "5", "5", "5", "7"],
    )
    assert [r.reason for r in results] == ["no_box", "unterminated_box", "empty_answer", "too_long", "unterminated_box"]
    assert all(r.reward == 0.0 and r.extracted is None for r in results)


def test_unparsable_answers_and_ground_truths(math_pool):
    results = math_pool.score(
        ["\\boxed{)(+}", "\\boxed{(-\\infty, 0) \\cup\\{1\\}.}", "\\boxed{2}", "\\boxed{\\text{a ghost}}"],
        ["1", "$(-\\infty, 0) \\cup\\{1\\}$.", "$(-\\infty, 0) \\cup\\{1\\}$.", "\\text{a ghost}"],
    )
    # The second ground truth defeats the grammar; an identical answer still counts as correct.
    assert [r.reason for r in results] == ["parse_error", "correct", "gold_parse_error", "correct"]


def test_duplicates_are_verified_once_and_order_is_kept(math_pool):
    responses = [boxed_response(str(i % 7)) for i in range(400)]
    answers = [str(i % 5) for i in range(400)]
    results = math_pool.score(responses, answers)
    assert [r.reward for r in results] == [1.0 if i % 7 == i % 5 else 0.0 for i in range(400)]
    assert results[0] is results[35]  # same (answer, ground truth): one verification, one result


def test_thousands_of_responses_in_one_batch(math_pool):
    n = 3000
    responses = [boxed_response(f"\\frac{{{i}}}{{{i + 1}}}") if i % 3 else boxed_response(str(i)) for i in range(n)]
    answers = [f"\\frac{{{i}}}{{{i + 1}}}" if i % 2 else str(i) for i in range(n)]
    started = time.perf_counter()
    results = math_pool.score(responses, answers)
    elapsed = time.perf_counter() - started
    expected = [1.0 if (i % 3 != 0) == (i % 2 == 1) else 0.0 for i in range(n)]
    # i % 3 == 0 and i % 2 == 0: both plain integers i, equal.
    assert [r.reward for r in results] == expected
    assert summarize_reasons(results)["error"] == 0
    assert elapsed < 60


def test_mismatched_inputs_are_rejected(math_pool):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        math_pool.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"answers\[0\] is float"):
        math_pool.score(["\\boxed{1}"], [1.0])
    assert math_pool.score([], []) == []


def test_a_stuck_worker_is_killed_and_replaced(tmp_path):
    hook = functools.partial(install_hang_and_crash, str(tmp_path))
    with RewardPool(num_workers=1, timeout_s=0.5, kill_grace_s=0.5, worker_init=hook) as pool:
        started = time.perf_counter()
        results = pool.score(["\\boxed{1}", "\\boxed{HANG}", "\\boxed{2}", "\\boxed{3}"], ["1", "1", "2", "4"])
        elapsed = time.perf_counter() - started
        assert [r.reason for r in results] == ["correct", "timeout", "correct", "wrong"]
        assert 0.9 < results[1].seconds < 5
        assert pool.workers_replaced == 1
        assert (tmp_path / "hang").read_text().count("\n") == 1  # the hook saw HANG once
        # The replacement serves the next batch.
        assert [r.reason for r in pool.score(["\\boxed{5}"], ["5"])] == ["correct"]
        assert pool.workers_replaced == 1
    assert elapsed < 30


def test_an_interruptible_slow_answer_times_out_without_a_restart():
    with RewardPool(num_workers=1, timeout_s=1.0, kill_grace_s=2.0) as pool:
        results = pool.score(["\\boxed{10^{10^{8}}}", "\\boxed{2}"], ["1", "2"])
        assert [r.reason for r in results] == ["timeout", "correct"]
        assert results[0].seconds < 2.0
        assert pool.workers_replaced == 0


def test_a_crashing_worker_costs_one_sample(tmp_path):
    hook = functools.partial(install_hang_and_crash, str(tmp_path))
    with RewardPool(num_workers=2, timeout_s=2.0, prefetch=4, worker_init=hook) as pool:
        answers = [str(i) for i in range(40)]
        responses = [boxed_response("CRASH" if i == 5 else str(i)) for i in range(40)]
        results = pool.score(responses, answers)
        assert [r.reason for r in results] == ["error" if i == 5 else "correct" for i in range(40)]
        assert pool.workers_replaced == 1
        assert [r.reward for r in pool.score(["\\boxed{8}"], ["8"])] == [1.0]


def test_a_worker_killed_between_batches_is_replaced():
    with RewardPool(num_workers=2) as pool:
        pool.wait_ready()
        assert all(w.ready for w in pool._workers)
        victim = pool._workers[0].proc
        victim.kill()
        victim.wait()
        results = pool.score([boxed_response(str(i)) for i in range(30)], [str(i) for i in range(30)])
        assert [r.reason for r in results] == ["correct"] * 30
        assert pool.workers_replaced == 1 and victim not in [w.proc for w in pool._workers]


def test_a_worker_that_cannot_start_is_an_error():
    pool = RewardPool(num_workers=1, worker_init=fail_to_start)
    with pytest.raises(RuntimeError, match="reward worker failed to start: OSError: this worker cannot start"):
        pool.wait_ready()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["\\boxed{1}"], ["1"])


def test_worker_init_must_be_picklable():
    with pytest.raises(TypeError, match="worker_init must be picklable"):
        RewardPool(num_workers=1, worker_init=lambda: None)


def test_a_batch_without_boxes_does_not_wait_for_the_workers():
    with RewardPool(num_workers=1) as pool:
        started = time.perf_counter()
        assert [r.reason for r in pool.score(["no box", "\\boxed{"], ["1", "1"])] == ["no_box", "unterminated_box"]
        assert time.perf_counter() - started < 0.5  # the worker is still starting


def test_exact_reward_needs_no_workers():
    with RewardPool.from_config(RewardConfig(kind="exact")) as pool:
        assert pool._workers == []
        results = pool.score(["7", " 7 ", "7 <d12>", "", "\\boxed{7}", "\\boxed{7", "3"], ["7"] * 6 + ["7"])
        assert [r.reason for r in results] == [
            "correct",
            "correct",
            "wrong",
            "empty_answer",
            "correct",
            "unterminated_box",
            "wrong",
        ]
        assert [r.extracted for r in results[:3]] == ["7", "7", "7 <d12>"]


def test_free_words_reward_takes_the_answer_before_the_free_words():
    with RewardPool.from_config(RewardConfig(kind="free_words")) as pool:
        assert pool._workers == []
        responses = ["7 w17 w203", "7", " 7\nw3 ", "3 w17", "w3 7", "7 3", "7 w1 <bos>", "7 wx", "", "\\boxed{7}"]
        results = pool.score(responses, ["7"] * len(responses))
        assert [r.reason for r in results] == ["correct"] * 3 + ["wrong"] * 5 + ["empty_answer", "wrong"]
        # Only a first word followed by free words is an answer: a digit, a special token or any
        # other word after the first leaves the response without one.
        assert [r.extracted for r in results] == ["7", "7", "7", "3", None, None, None, None, None, "\\boxed{7}"]
    with RewardPool(kind="free_words", max_answer_chars=10) as pool:
        assert pool.score(["8" * 20 + " w1"], ["8"])[0].reason == "too_long"


def test_close_stops_the_workers():
    pool = RewardPool(num_workers=2)
    procs = [w.proc for w in pool._workers]
    assert pool.score(["\\boxed{1}"], ["1"])[0].reward == 1.0
    pool.close()
    pool.close()
    assert all(p.poll() is not None for p in procs)


def test_a_dead_workers_sent_results_settle_before_its_crash_is_charged():
    """A send can find a worker dead before its last answers were read: those answers still count,
    and only the sample it died on is an error (it must not be retried on a fresh worker)."""
    import collections
    import multiprocessing

    with RewardPool(num_workers=1, timeout_s=2.0, prefetch=4) as pool:
        pool.wait_ready()
        worker = pool._workers[0]
        ours, theirs = multiprocessing.Pipe()
        worker.conn.close()
        worker.conn = ours
        worker.inflight = collections.deque([3, 4, 5])
        theirs.send((3, "correct", 0.01, 1.0, None))
        theirs.send((4, "wrong", 0.02, 0.0, None))
        theirs.close()  # the worker died on task 5
        queue, out = collections.deque(), [None] * 6
        settled = pool._on_death(worker, queue, out)
        assert settled == 3
        assert out[3] == ("correct", 0.01, 1.0, None) and out[4] == ("wrong", 0.02, 0.0, None)
        assert (out[5][0], out[5][2]) == ("error", 0.0)
        assert out[5][3].startswith("the worker died on it (exit code ")
        assert not queue  # nothing is retried
