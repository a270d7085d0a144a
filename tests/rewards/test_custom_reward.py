"""reward.kind custom: a user's function, imported and called in the reward workers only.

The functions are in tests/rewards/custom_reward_functions.py; every result comes from a real pool.
"""

from __future__ import annotations

import sys

import pytest

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.rewards import RewardConfig, RewardPool, check_reward_function
from stapo_megatron.trainer.config import TrainConfig
from tests.rewards.custom_reward_functions import BAD_RETURNS, VALID_RETURNS

FUNCTIONS = "tests.rewards.custom_reward_functions"


def custom_pool(function: str, **kwargs) -> RewardPool:
    return RewardPool(kind="custom", function=f"{FUNCTIONS}:{function}", **{"num_workers": 1, **kwargs})


def outcomes(results) -> list[tuple[str, float, str | None]]:
    return [(r.reason, r.reward, r.detail) for r in results]


def test_returned_scores_become_rewards_and_reasons():
    with custom_pool("scripted", num_workers=2) as pool:
        results = pool.score(list(VALID_RETURNS), ["4"] * len(VALID_RETURNS))
    assert outcomes(results) == [expected for _, expected in VALID_RETURNS.values()]
    assert [r.reward for r in results] == [0.25, 1.0, 0.0, 1.0, 0.0, 0.75, 1.0, 0.0, 0.5, 1.0, 0.0, 0.5, 1.0]
    assert all(r.extracted is None for r in results)


def test_a_return_that_is_not_a_score_is_a_scored_error_and_the_pool_goes_on():
    with custom_pool("scripted") as pool:
        results = pool.score(list(BAD_RETURNS), ["4"] * len(BAD_RETURNS))
        for result, (_, detail) in zip(results, BAD_RETURNS.values()):
            assert (result.reason, result.reward) == ("error", 0.0)
            assert result.detail is not None and result.detail.startswith(detail), (result.detail, detail)
        assert outcomes(pool.score(["pair"], ["4"])) == [("partial", 0.75, "three of four steps")]
        assert pool.workers_replaced == 0


def test_the_data_row_reaches_the_function():
    row = {"id": 7, "partial_credit": 0.5, "extra_info": {"split": "train"}}
    other = {"id": 8, "partial_credit": 0.25}
    with custom_pool("with_row", num_workers=2) as pool:
        results = pool.score(["12", "12", "11", "11", "11"], ["12", "12", "12", "12", "12"], [row, row, row, other, {}])
        without_rows = pool.score(["11", "12"], ["12", "12"])
    quoted = '{"extra_info": {"split": "train"}, "id": 7, "partial_credit": 0.5}'
    assert outcomes(results) == [
        ("correct", 1.0, f"exact; row {quoted}"),
        ("correct", 1.0, f"exact; row {quoted}"),
        ("partial", 0.5, f"row {quoted}"),
        ("partial", 0.25, 'row {"id": 8, "partial_credit": 0.25}'),
        ("wrong", 0.0, "row {}"),
    ]
    # One call per (response, ground truth, row): a prompt's G samples share their row.
    assert results[0] is results[1]
    assert outcomes(without_rows) == [("wrong", 0.0, "row {}"), ("correct", 1.0, "exact; row {}")]


def test_other_kinds_take_the_rows_and_ignore_them(math_pool):
    results = math_pool.score(["\\boxed{12}", "\\boxed{11}"], ["12", "12"], [{"id": 1}, {"id": 2}])
    assert [(r.reason, r.reward, r.extracted, r.detail) for r in results] == [
        ("correct", 1.0, "12", None),
        ("wrong", 0.0, "11", None),
    ]


def test_bad_rows_are_refused_in_one_line(math_pool):
    with pytest.raises(ValueError, match=r"^RewardPool.score: 2 responses but 1 extras$"):
        math_pool.score(["a", "b"], ["1", "2"], [{}])
    with pytest.raises(TypeError, match=r"^RewardPool.score: extras\[1\] is list, expected dict$"):
        math_pool.score(["a", "b"], ["1", "2"], [{}, []])


def test_a_row_that_cannot_be_sent_to_a_worker_is_a_scored_error():
    with custom_pool("with_row") as pool:
        results = pool.score(["12", "12"], ["12", "12"], [{"bad": lambda: None}, {"id": 3}])
    assert results[0].reason == "error" and results[0].reward == 0.0
    assert results[0].detail.startswith("its data row cannot be sent to a reward worker: ")
    assert outcomes(results[1:]) == [("correct", 1.0, 'exact; row {"id": 3}')]


def test_a_function_that_raises_is_a_scored_error_and_the_pool_goes_on():
    with custom_pool("raises") as pool:
        results = pool.score(["x", "exit", "fine"], ["4", "4", "4"])
        assert outcomes(results) == [
            ("error", 0.0, "raised ValueError: cannot grade 'x' against '4'"),
            ("error", 0.0, "raised SystemExit: 3"),
            ("correct", 1.0, None),
        ]
        assert outcomes(pool.score(["fine"], ["4"])) == [("correct", 1.0, None)]
        assert pool.workers_replaced == 0


def test_a_hanging_function_is_stopped_at_its_time_limit_and_the_pool_scores_the_next_batch():
    with custom_pool("hangs", timeout_s=0.5, kill_grace_s=0.5) as pool:
        # Interruptible: SIGALRM ends the call, the worker stays.
        first = pool.score(["HANG", "4", "5"], ["4", "4", "4"])
        assert outcomes(first) == [
            ("timeout", 0.0, "ran past timeout_s=0.5 s"),
            ("correct", 1.0, None),
            ("wrong", 0.0, None),
        ]
        assert first[0].seconds >= 0.5
        assert pool.workers_replaced == 0
        # Deaf to SIGALRM (like a long C call): the pool kills the worker and starts another.
        second = pool.score(["HANG BLOCKED", "4", "5"], ["4", "4", "4"])
        assert (second[0].reason, second[0].reward) == ("timeout", 0.0)
        assert second[0].detail.startswith("worker killed after ")
        assert outcomes(second[1:]) == [("correct", 1.0, None), ("wrong", 0.0, None)]
        assert pool.workers_replaced == 1
        assert outcomes(pool.score(["7", "8"], ["7", "7"])) == [("correct", 1.0, None), ("wrong", 0.0, None)]


def test_the_memory_limit_applies():
    with custom_pool("allocates", memory_limit_mb=1024) as pool:
        assert outcomes(pool.score(["x"], ["4"])) == [("error", 0.0, "raised MemoryError")]


def test_model_output_is_never_evaluated():
    attack = "__import__('os').getpid() and 1"
    with custom_pool("evaluates") as pool:
        [result] = pool.score([attack], ["1"])
    assert (result.reason, result.reward) == ("error", 0.0)
    assert result.detail.startswith(f"blocked a code evaluation: eval called from {FUNCTIONS} is blocked")
    # forbid_code_eval takes effect: without the guard the same function evaluates (here, harmless) text.
    with custom_pool("evaluates", forbid_code_eval=False) as pool:
        assert outcomes(pool.score(["1", "0.5"], ["1", "1"])) == [("correct", 1.0, None), ("partial", 0.5, None)]


def test_an_instance_with_call_is_a_function():
    with custom_pool("half_credit") as pool:
        assert outcomes(pool.score(["3", "4"], ["3", "3"])) == [("partial", 0.5, None), ("wrong", 0.0, None)]


def test_the_check_and_the_pool_never_import_the_module_in_this_process():
    module = "tests.rewards.custom_reward_isolated"
    cfg = RewardConfig(kind="custom", function=f"{module}:score", num_workers=1)
    check_reward_function(cfg)
    with RewardPool.from_config(cfg) as pool:
        assert outcomes(pool.score(["3", "4"], ["3", "3"])) == [("correct", 1.0, None), ("wrong", 0.0, None)]
    assert module not in sys.modules


def check_error(function: str) -> str:
    with pytest.raises(ConfigError) as info:
        check_reward_function(RewardConfig(kind="custom", function=function))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "function, message",
    [
        (
            "tests.rewards.no_such_module:score",
            "cannot import module 'tests.rewards.no_such_module' (ModuleNotFoundError: No module named "
            "'tests.rewards.no_such_module'; is it installed or on PYTHONPATH?)",
        ),
        (
            "tests.rewards.custom_reward_broken:score",
            "cannot import module 'tests.rewards.custom_reward_broken' (RuntimeError: this reward module is broken "
            "on purpose)",
        ),
        (f"{FUNCTIONS}:nope", f"{FUNCTIONS} has no attribute 'nope'"),
        (f"{FUNCTIONS}:Grader.nope", f"{FUNCTIONS}:Grader has no attribute 'nope'"),
        (f"{FUNCTIONS}:NOT_A_FUNCTION", f"{FUNCTIONS}:NOT_A_FUNCTION is not a function (its type is int)"),
        (f"{FUNCTIONS}:Grader", f"{FUNCTIONS}:Grader is a class; name a function (or an object with __call__)"),
        (
            f"{FUNCTIONS}:asynchronous",
            f"{FUNCTIONS}:asynchronous is an async function; a reward function returns its score directly",
        ),
    ],
)
def test_a_function_that_cannot_be_loaded_is_one_line_at_config_time(function, message):
    assert check_error(function) == f"reward.function: {message}"


@pytest.mark.parametrize(
    "function, signature, why",
    [
        ("two_arguments", "(response, ground_truth)", "too many positional arguments"),
        ("extra_by_keyword_only", "(response, ground_truth, *, extra)", "too many positional arguments"),
    ],
)
def test_a_wrong_signature_is_one_line_at_config_time(function, signature, why):
    assert check_error(f"{FUNCTIONS}:{function}") == (
        f"reward.function: {FUNCTIONS}:{function}{signature} cannot be called as function(response, ground_truth, "
        f"extra): {why}"
    )


def test_functions_that_take_three_positional_arguments_pass_the_check():
    for function in ("scripted", "any_arguments", "half_credit"):
        check_reward_function(RewardConfig(kind="custom", function=f"{FUNCTIONS}:{function}", num_workers=4))
    check_reward_function(RewardConfig(kind="math"))  # nothing to check, no worker started


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.kind=custom"], "reward.function: required with kind custom ('package.module:function')"),
        (
            ["reward.kind=custom", "reward.function=my_rewards.score"],
            "reward.function: expected 'package.module:function', got 'my_rewards.score'",
        ),
        (
            ["reward.kind=custom", "reward.function=my rewards:score"],
            "reward.function: expected 'package.module:function', got 'my rewards:score'",
        ),
        (["reward.function=my_rewards:score"], "reward.function: only kind custom calls a function, kind is math"),
    ],
)
def test_the_config_field_is_checked_when_loaded(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, overrides)
    assert str(info.value) == message


def test_the_config_docs_document_the_field():
    from stapo_megatron.config import describe

    rows = {name: (type_name, default, doc) for name, type_name, default, doc in describe(TrainConfig)}
    assert "custom: the function named by reward.function" in rows["reward.kind"][2]
    assert "'package.module:function'" in rows["reward.function"][2]
    assert "function(response, ground_truth, extra)" in rows["reward.function"][2]


def test_a_reward_function_sees_no_key_token_or_rank_identity(monkeypatch):
    """The workers start from an allow-list (the interpreter's, the locale's, the thread counts) plus
    reward.pass_env: the trainer's secrets and torchrun's variables never reach a reward function."""
    from stapo_megatron.rollout.sglang_launch import KEY_ENV
    from stapo_megatron.runtime.run_lock import TOKEN_ENV

    secret = {
        KEY_ENV: "sglang-key",
        TOKEN_ENV: "lock-token",
        "HF_TOKEN": "hf_x",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "STAPO_TEST_PASSED": "yes",
    }
    for name, value in secret.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    asked = ",".join([*secret, "PATH", "LC_ALL"])
    pool = custom_pool("reports_its_environment", pass_env=["STAPO_TEST_PASSED"])
    try:
        [result] = pool.score([asked], ["x"])
    finally:
        pool.close()
    assert result.reward == 1.0 and result.detail == "STAPO_TEST_PASSED,PATH,LC_ALL", result
    with pytest.raises(ConfigError, match=r"^pass_env: 'A-B' is not an environment variable name$"):
        RewardConfig(pass_env=["A-B"])


def test_what_a_reward_function_prints_never_reaches_the_commands_stdout(tmp_path):
    """stdout is a command's product (stapo eval's table): a reward function's prints go to stderr."""
    import subprocess

    from tests.helpers import REPO_ROOT

    script = (
        "from stapo_megatron.rewards import RewardPool\n"
        f"pool = RewardPool(kind='custom', function='{FUNCTIONS}:prints', num_workers=1)\n"
        "print('table:', [r.reward for r in pool.score(['a', 'b'], ['1', '1'])])\n"
        "pool.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "table: [1.0, 1.0]\n"
    assert "scoring a" in done.stderr and "scoring b" in done.stderr
