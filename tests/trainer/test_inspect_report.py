"""`stapo inspect`'s comparison of the silenced tokens with the STAPO paper's token classes,
on a hand-made dump with known counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo_megatron.cli import main
from stapo_megatron.trainer.inspector import DUMP_DIR, paper_class, paper_comparison, read_dumps, step_groups

# step -> silenced tokens, as the trainer decodes them (Qwen-style leading space in " x").
DUMP = {10: ["3", "3", "<d5>", "$"], 20: [" x", "<d5>", "<d5>", "12"], 30: ["<d7>"]}


def write_dump(run_dir):
    directory = run_dir / DUMP_DIR
    directory.mkdir(parents=True)
    for step, tokens in DUMP.items():
        with open(directory / f"step_{step:07d}.jsonl", "w", encoding="utf-8") as f:
            for position, token in enumerate(tokens):
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "sequence": 0,
                            "position": position,
                            "token_id": 100 + position,
                            "token": token,
                            "probability": 1e-3,
                            "entropy": 0.5,
                            "advantage": 1.0,
                            "correct": True,
                            "before": "7 + 6 =",
                            "after": "<eos>",
                        }
                    )
                    + "\n"
                )


def test_paper_classes_by_decoded_text():
    assert [paper_class(t) for t in ["3", " 42", "\u00b2", "$", " $$", "x", " x", "X", "xy", "<d5>", "", " "]] == [
        "digit",
        "digit",
        None,
        "$",
        "$",
        "x",
        "x",
        None,
        None,
        None,
        None,
        None,
    ]


def test_step_groups_cut_dumps_evenly():
    assert step_groups([10, 20, 30], 5) == [[10], [20], [30]]
    assert step_groups([10, 20, 30], 2) == [[10], [20, 30]]
    assert step_groups(list(range(1, 8)), 3) == [[1, 2], [3, 4], [5, 6, 7]]


def test_per_step_rows_count_the_paper_classes(tmp_path):
    write_dump(tmp_path)
    lines = paper_comparison(read_dumps(tmp_path), top=2, max_rows=2)
    assert lines[2].split()[:7] == ["steps", "silenced", "digit", "$", "x", "paper", "most"]
    # step 10: 2 digits and one "$" of 4; steps 20..30: one digit, one " x" of 5; all: 3 + 1 + 1 of 9.
    assert lines[3].split() == ["10", "4", "50.0%", "25.0%", "0.0%", "75.0%", "'3'*", "2,", "'<d5>'", "1"]
    assert lines[4].split() == ["20..30", "5", "20.0%", "0.0%", "20.0%", "40.0%", "'<d5>'", "2,", "'", "x'*", "1"]
    assert lines[5].split() == ["all", "9", "33.3%", "11.1%", "11.1%", "55.6%", "'<d5>'", "3,", "'3'*", "2"]
    assert len(lines) == 6


def test_inspect_command_keeps_the_ranking_and_adds_the_comparison(tmp_path, capsys):
    write_dump(tmp_path)
    assert main(["inspect", str(tmp_path), "--per-step-top", "1", "--step-rows", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "9 silenced tokens in 3 dumps (steps 10..30), 6 distinct"
    ranking = {line.split()[1]: line.split() for line in out[3:9]}
    assert ranking["'<d5>'"][2:4] == ["3", "33.33%"] and ranking["'<d5>'"][-1] == "-"
    assert ranking["'3'"][2:4] == ["2", "22.22%"] and ranking["'3'"][-1] == "digit"
    assert ranking["'$'"][-1] == "$" and ranking["'12'"][-1] == "digit"
    assert any("...7 + 6 =[[3]]<eos>..." in line for line in out)
    rows = [line.split() for line in out if line.split()[:1] in (["10"], ["20"], ["30"], ["all"])]
    assert [row[:2] + row[5:] for row in rows] == [
        ["10", "4", "75.0%", "'3'*", "2"],
        ["20", "4", "50.0%", "'<d5>'", "2"],
        ["30", "1", "0.0%", "'<d7>'", "1"],
        ["all", "9", "55.6%", "'<d5>'", "3"],
    ]


def test_inspect_rejects_zero_rows(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(tmp_path), "--step-rows", "0"])
    assert exit_.value.code == 2
    assert "--step-rows: must be at least 1, got 0" in capsys.readouterr().err


def test_dumped_context_reaches_into_its_own_prompt_and_no_further():
    """Two sequences packed in one row: the silenced token's context before it is its response and
    then its own prompt (from the token after BOS), never the sequence packed before it."""
    from types import SimpleNamespace

    import torch

    from stapo_megatron.trainer.inspector import SpuriousTokenDump

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(str(i) for i in ids)

    # sequence 0: BOS 10 20 | 30 31; sequence 1: BOS 11 21 | 32 33 (labels: each sequence's next tokens)
    labels = torch.tensor([[10, 20, 30, 31, 0, 11, 21, 32, 33, 0]])
    response = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1, 0]], dtype=torch.float32)
    mb = {
        "labels": labels,
        "response_mask": response,
        "segment_ids": torch.tensor([[0] * 5 + [1] * 5]),
        "sequence_index": torch.tensor([0, 1]),
        "advantages": response.clone(),
    }
    silenced_at = torch.zeros(1, 10, dtype=torch.bool)
    silenced_at[0, 8] = silenced_at[0, 3] = True
    selection = SimpleNamespace(keep=(~silenced_at).float(), candidates=silenced_at)
    stats = SimpleNamespace(logprob=torch.full((1, 10), -6.0), entropy=torch.full((1, 10), 0.5))
    batch = SimpleNamespace(correct=torch.ones(2))
    for context, expected in ((16, ["10 20 30", "11 21 32"]), (2, ["20 30", "21 32"])):
        dump = SpuriousTokenDump(Path("unused"), Tokenizer(), context, ctx=None)
        entries = dump._entries(7, [[mb]], [[stats]], [[selection]], batch)
        assert [e["before"] for e in entries] == expected
        assert [(e["sequence"], e["position"], e["after"]) for e in entries] == [(0, 1, ""), (1, 1, "")]
