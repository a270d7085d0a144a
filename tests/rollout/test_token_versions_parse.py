"""Per-token weight versions from SGLang's /generate answers: the segments of 0.5.23, the single
``weight_version`` of earlier servers, and what the engine may accept given the versions it sent
while a request ran."""

from __future__ import annotations

import pytest

from stapo_megatron.rollout.engine import Completion
from stapo_megatron.rollout.sglang_client import SGLangResponseError
from stapo_megatron.rollout.sglang_generate import (
    AbortedSample,
    StaleAnswer,
    VersionWindow,
    parse_generate,
    version_number,
)

URL = "http://server-7:30000"


def item(count: int, segments=None, version=None) -> dict:
    """One answer item of ``count`` tokens, as SGLang shapes it (segments: (version, start, end))."""
    meta: dict = {
        "finish_reason": {"type": "length", "length": count},
        "output_token_logprobs": [[-0.5 - i, 10 + i, None] for i in range(count)],
    }
    if version is not None:
        meta["weight_version"] = version
    if segments is not None:
        meta["weight_versions"] = [{"version": v, "start": s, "end": e} for v, s, e in segments]
    return {"output_ids": [10 + i for i in range(count)], "meta_info": meta}


def versions_of(answer: dict, window: VersionWindow) -> list[int] | None:
    [[completion]] = parse_generate(answer, 1, 1, URL, window)
    assert completion.token_ids == [10 + i for i in range(len(completion.token_ids))]
    return completion.versions


def test_one_segment_gives_every_token_its_version():
    assert versions_of(item(4, [("3", 0, 4)], "3"), VersionWindow(sent=3)) == [3, 3, 3, 3]


def test_a_sync_during_the_request_splits_the_tokens_by_version():
    answer = item(5, [("3", 0, 2), ("4", 2, 5)], "4")
    assert versions_of(answer, VersionWindow(sent=3, synced=(4,))) == [3, 3, 4, 4, 4]
    # A sync still open when the answer came (its version is known only once it completes): one more
    # version after the known ones is accepted, and only one.
    assert versions_of(answer, VersionWindow(sent=3, open=True)) == [3, 3, 4, 4, 4]
    assert versions_of(item(3, [("4", 0, 3)], "4"), VersionWindow(sent=3, open=True)) == [4, 4, 4]
    with pytest.raises(StaleAnswer, match=r"weight version '5'; the engine sent 3 then the version being synced"):
        versions_of(item(3, [("3", 0, 1), ("4", 1, 2), ("5", 2, 3)]), VersionWindow(sent=3, open=True))
    # Two syncs while it ran, and the same version sent twice.
    assert versions_of(item(3, [("3", 0, 1), ("5", 1, 3)]), VersionWindow(sent=3, synced=(4, 5))) == [3, 5, 5]
    assert versions_of(item(2, [("3", 0, 1), ("3", 1, 2)]), VersionWindow(sent=3, synced=(3,))) == [3, 3]


def test_versions_the_engine_did_not_send_while_the_request_ran_are_stale():
    """No sync during the request: every token must be of the version sent. A restarted server's launch
    weights ('default') and any other version are StaleAnswer, an SGLangResponseError naming the server."""
    with pytest.raises(StaleAnswer, match=rf"^{URL}/generate item 0 was generated with weight version '4'; "):
        versions_of(item(4, [("3", 0, 2), ("4", 2, 4)], "4"), VersionWindow(sent=3))
    with pytest.raises(StaleAnswer, match=r"'default' \(launch weights: the server restarted\); the engine sent 3"):
        versions_of(item(4, [("default", 0, 4)], "default"), VersionWindow(sent=3))
    with pytest.raises(StaleAnswer, match="'2'"):
        versions_of(item(4, [("2", 0, 4)], "2"), VersionWindow(sent=3, synced=(4,)))
    assert issubclass(StaleAnswer, SGLangResponseError)


@pytest.mark.parametrize("served", ["default", "3.0", " 3", "03", "v3", "", None, 3.0, True, ["3"]])
def test_a_version_that_is_not_an_integer_the_engine_sent_is_stale(served):
    assert version_number(served) is None
    with pytest.raises(StaleAnswer, match=URL):
        versions_of(item(2, [(served, 0, 2)]), VersionWindow(sent=3))


def test_an_answer_without_tokens_has_one_empty_segment():
    assert versions_of(item(0, [("3", 0, 0)], "3"), VersionWindow(sent=3)) == []
    with pytest.raises(SGLangResponseError, match=r"a segment \[0, 0\)"):
        versions_of(item(1, [("3", 0, 0), ("3", 0, 1)]), VersionWindow(sent=3))


def test_version_numbers():
    assert [version_number(v) for v in ("7", "0", "-1", 7, "12345678901")] == [7, 0, -1, 7, 12345678901]


def test_weights_never_go_back_within_a_request():
    with pytest.raises(SGLangResponseError, match=r"go back to version 3") as caught:
        versions_of(item(4, [("4", 0, 2), ("3", 2, 4)]), VersionWindow(sent=3, synced=(4,)))
    assert not isinstance(caught.value, StaleAnswer)


@pytest.mark.parametrize(
    "segments, problem",
    [
        ([("3", 0, 2)], r"cover 2 of its 4 output tokens"),
        ([("3", 0, 5)], r"cover 5 of its 4 output tokens"),
        ([("3", 1, 4)], r"a segment \[1, 4\) where token 0 comes next"),
        ([("3", 0, 2), ("3", 3, 4)], r"a segment \[3, 4\) where token 2 comes next"),
        ([("3", 0, 3), ("3", 2, 4)], r"a segment \[2, 4\) where token 3 comes next"),
        ([("3", 0, 0), ("3", 0, 4)], r"a segment \[0, 0\)"),
        ([("3", 2, 4), ("3", 0, 2)], r"a segment \[2, 4\) where token 0 comes next"),
        ([], r"cover 0 of its 4 output tokens"),
    ],
)
def test_segments_must_tile_the_output_tokens_in_order(segments, problem):
    with pytest.raises(SGLangResponseError, match=rf"^{URL}/generate item 0: weight_versions .*{problem}"):
        versions_of(item(4, segments), VersionWindow(sent=3))


@pytest.mark.parametrize(
    "weight_versions",
    [
        {"version": "3", "start": 0, "end": 4},  # a segment, not a list of them
        [{"version": "3", "start": 0}],
        [{"start": 0, "end": 4}],
        [{"version": "3", "start": "0", "end": 4}],
        [{"version": "3", "start": False, "end": 4}],
        [["3", 0, 4]],
    ],
)
def test_malformed_segments_are_a_response_error(weight_versions):
    answer = item(4)
    answer["meta_info"]["weight_versions"] = weight_versions
    with pytest.raises(SGLangResponseError, match=rf"^{URL}/generate item 0: weight_versions"):
        versions_of(answer, VersionWindow(sent=3))


def test_servers_before_0_5_23_give_their_one_version_to_every_token():
    assert versions_of(item(3, version="3"), VersionWindow(sent=3)) == [3, 3, 3]
    assert versions_of(item(3, version="3"), VersionWindow(sent=3, synced=(4,))) == [3, 3, 3]  # answered before it
    with pytest.raises(StaleAnswer, match="'default'"):
        versions_of(item(3, version="default"), VersionWindow(sent=3))
    # Weights changed while it ran and the answer cannot say which tokens came from which: sent again.
    with pytest.raises(AbortedSample, match="before 0.5.23 reports no per-token weight versions"):
        versions_of(item(3, version="4"), VersionWindow(sent=3, synced=(4,)))
    with pytest.raises(AbortedSample):
        versions_of(item(3, version="4"), VersionWindow(sent=3, open=True))
    assert versions_of(item(3), VersionWindow(sent=3)) is None  # an answer that names no version


def test_launch_weights_carry_no_version():
    """Before the engine sent any version the servers hold their launch weights (a fresh server reports
    'default'): no version, whatever the server reports; tokens partly from them have none either."""
    assert versions_of(item(3, [("default", 0, 3)], "default"), VersionWindow()) is None
    assert versions_of(item(3, [("42", 0, 3)], "42"), VersionWindow()) is None  # numbered by someone else
    assert versions_of(item(3, version="default"), VersionWindow()) is None
    first_sync = VersionWindow(sent=None, open=True)
    assert versions_of(item(3, [("default", 0, 1), ("0", 1, 3)]), first_sync) is None
    assert versions_of(item(3, [("0", 0, 3)]), first_sync) == [0, 0, 0]
    assert versions_of(item(3, [("default", 0, 1), ("0", 1, 3)]), VersionWindow(synced=(0,))) is None


def test_every_item_of_a_batch_gets_its_own_versions():
    answer = [item(2, [("3", 0, 2)]), item(3, [("3", 0, 1), ("4", 1, 3)])]
    groups = parse_generate(answer, 1, 2, URL, VersionWindow(sent=3, synced=(4,)))
    assert [c.versions for c in groups[0]] == [[3, 3], [3, 4, 4]]
    answer[1]["meta_info"]["weight_versions"][1]["end"] = 2
    with pytest.raises(SGLangResponseError, match=rf"^{URL}/generate item 1: .*cover 2 of its 3"):
        parse_generate(answer, 1, 2, URL, VersionWindow(sent=3, synced=(4,)))


def test_a_completion_has_one_version_per_token():
    assert Completion([1, 2], [-0.1, -0.2], "stop", versions=[0, 1]).versions == [0, 1]
    assert Completion([1, 2], [-0.1, -0.2], "stop").versions is None
    with pytest.raises(ValueError, match="2 tokens but 1 weight versions"):
        Completion([1, 2], [-0.1, -0.2], "stop", versions=[0])
