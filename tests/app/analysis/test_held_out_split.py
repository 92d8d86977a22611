"""bench.divergence_length keeps its frozen held-out seeds out of every other run: `--seeds-from` (a fresh range to
explore) refuses a range that reaches them, and `--held-out` takes no slice, each with one line naming the value."""

from __future__ import annotations

import pytest

from tests.helpers.divergence import HELD_OUT_SEEDS, bench_common, length_main


@pytest.mark.parametrize("argv, says", [
    (["--seeds-from", str(HELD_OUT_SEEDS.start - 10)], f"--seeds-from {HELD_OUT_SEEDS.start - 10}: seeds"),
    (["--seeds-from", str(HELD_OUT_SEEDS.start + 50)], "reach the held-out seeds"),
    (["--seeds-from", "-3"], "--seeds-from -3"),
    (["--held-out", "--seeds-from", "1000"], "drop --refs/--lengths/--kinds/--count/--seeds-from"),
])
def test_a_range_that_reaches_the_held_out_seeds_is_refused(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        length_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's usage, then one line: the error
    assert "error: " in last and says in last and "Traceback" not in err


def test_a_range_clear_of_them_runs(capsys, monkeypatch, tmp_path):
    # one comparison of the shortest runs, one kind: the range's first seed is drawn, none of the frozen ones
    monkeypatch.setattr(bench_common, "RESULTS", tmp_path)  # its result file, not over the repository's
    assert length_main(["--seeds-from", str(HELD_OUT_SEEDS.stop), "--lengths", "1000", "--kinds", "none",
                        "--count", "1"]) == 0
    assert f"seeds from {HELD_OUT_SEEDS.stop}" in capsys.readouterr().out
    assert (tmp_path / "divergence_length_slice.json").is_file()
