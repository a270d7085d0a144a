"""`stapo plot` draws the entropy quantiles and the quadrants' gradient-norm shares from a
metrics.jsonl, and `stapo inspect` prints the quadrant shares per range of steps, exact over each
range (summed counts and norms, not a mean of the steps' shares)."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.cli import main
from stapo_megatron.trainer.metrics import METRICS_FILE
from tests.trainer.test_inspect_report import write_dump

QUADRANTS = ("lowp_lowh", "lowp_highh", "highp_lowh", "highp_highh")


def _row(step: int) -> dict:
    """Steps 1-2: gradient-norm sum 10, shares 40/30/20/10 %; steps 3-4: sum 30, shares 10/20/30/40 %;
    step 5: no positive-advantage token (shares null). Tokens 10/20/30/40 of 100 on steps 1-4."""
    row = {"step": step, "reward/accuracy": 0.1 * step, "policy/entropy": 2.0 - 0.1 * step}
    row.update({f"policy/entropy_p{n}": n / 100 + step for n in (50, 80, 90, 99)})
    if step == 5:
        row.update({"quadrant/positive_tokens": 0.0, "quadrant/grad_norm_sum": 0.0})
        row.update({f"quadrant/{q}_tokens": 0.0 for q in QUADRANTS})
        row.update({f"quadrant/{q}_grad_share": None for q in QUADRANTS})
        return row
    shares = (0.4, 0.3, 0.2, 0.1) if step <= 2 else (0.1, 0.2, 0.3, 0.4)
    row.update({"quadrant/positive_tokens": 100.0, "quadrant/grad_norm_sum": 10.0 if step <= 2 else 30.0})
    row.update({f"quadrant/{q}_tokens": float(10 * (k + 1)) for k, q in enumerate(QUADRANTS)})
    row.update({f"quadrant/{q}_grad_share": share for q, share in zip(QUADRANTS, shares)})
    return row


def _write_run(run_dir, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_draws_the_entropy_quantiles_and_the_quadrant_shares(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    run = tmp_path / "run"
    _write_run(run, [_row(s) for s in range(1, 6)])
    drawn = {}
    savefig = matplotlib.figure.Figure.savefig

    def recording(figure, *args, **kwargs):
        for axis in figure.axes:
            if axis.get_visible():
                drawn[axis.get_title()] = {line.get_label(): list(line.get_ydata()) for line in axis.get_lines()}
        return savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    assert main(["plot", str(run), "--window", "1"]) == 0
    assert capsys.readouterr().out == f"wrote {run / 'curves.png'}\n"
    assert (run / "curves.png").stat().st_size > 10_000
    quantiles = drawn["policy entropy quantiles (every response token)"]
    assert list(quantiles) == ["p50", "p80", "p90", "p99"]
    for n in (50, 80, 90, 99):
        assert quantiles[f"p{n}"] == pytest.approx([n / 100 + s for s in range(1, 6)])
    shares = drawn["A > 0 tokens' share of the gradient norm (lowp: p < tau_p, lowh: H < split)"]
    assert list(shares) == list(QUADRANTS)
    assert shares["lowp_lowh"] == pytest.approx([0.4, 0.4, 0.1, 0.1])  # step 5's null share is no point
    assert drawn["policy entropy (every response token)"]["run"] == pytest.approx([1.9, 1.8, 1.7, 1.6, 1.5])


def test_inspect_prints_the_quadrant_shares_per_step_range(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, [_row(s) for s in range(1, 6)])
    assert main(["inspect", str(run), "--step-rows", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run}: no silenced tokens recorded (see logging.inspect_every)"  # a run without dumps
    header = next(i for i, line in enumerate(out) if line.startswith("steps"))
    assert out[header].split() == ["steps", "A>0", "tokens", *QUADRANTS]
    rows = [line.split() for line in out[header + 1 :]]

    def cells(*grad):  # "token share / gradient-norm share" per quadrant; tokens 10/20/30/40 % throughout
        return [x for token, g in zip(("10.0%", "20.0%", "30.0%", "40.0%"), grad) for x in (token, "/", g)]

    assert rows == [
        ["1..2", "200", *cells("40.0%", "30.0%", "20.0%", "10.0%")],
        ["3..5", "200", *cells("10.0%", "20.0%", "30.0%", "40.0%")],
        # weighted by each step's gradient-norm sum (10, 10, 30, 30): not the plain mean, 25 % each
        ["all", "400", *cells("17.5%", "22.5%", "27.5%", "32.5%")],
    ]


def test_inspect_shows_the_quadrants_after_the_silenced_tokens_and_none_for_older_runs(tmp_path, capsys):
    write_dump(tmp_path)
    _write_run(tmp_path, [_row(s) for s in (1, 2)])
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("positive-advantage tokens by quadrant"))
    assert any(line.startswith("all ") and "55.6%" in line for line in out[:first])  # the paper comparison first
    assert out[-2].split()[:2] == ["2", "100"] and out[-1].split()[:2] == ["all", "200"]

    older = tmp_path / "older"
    _write_run(older, [{"step": 1, "reward/accuracy": 0.5, "policy/entropy": 1.0}])
    assert main(["inspect", str(older)]) == 0
    assert capsys.readouterr().out == f"{older}: no silenced tokens recorded (see logging.inspect_every)\n"
