"""The benchmarks' shared harness: one percentile definition, the side-by-side table, the closing
JSON line and the /proc CPU readings every benchmark reports through."""

from __future__ import annotations

import json
import os
import random
import statistics
from pathlib import Path

import pytest

from benchmarks.harness import (
    Table,
    json_line,
    minimal_smolfile,
    percentile,
    print_json,
    stat_cpu_s,
)
from fleet.core.smolfile import parse_smolfile


def test_percentile_interpolates_between_the_closest_ranks() -> None:
    # Hand-computed, type 7: rank (n - 1) * q, interpolated linearly.
    values = [4.0, 1.0, 3.0, 2.0]  # (unsorted on purpose)
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 4.0
    assert percentile(values, 0.5) == 2.5  # rank 1.5
    assert percentile(values, 0.99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 0.25) == pytest.approx(1.75)  # rank 0.75
    assert percentile([7.5], 0.99) == 7.5
    ten = [float(v) for v in range(1, 11)]
    assert percentile(ten, 0.9) == pytest.approx(9.1)  # rank 8.1
    # The nearest-rank-above rule the session and spawn benchmarks used returned the largest.
    assert percentile(ten, 0.99) == pytest.approx(9.91)
    assert values == [4.0, 1.0, 3.0, 2.0]  # the caller's list is left as it was


def test_percentile_at_half_is_the_median_bit_for_bit() -> None:
    rng = random.Random(41)
    for n in (1, 2, 3, 10, 31, 300):
        values = [rng.lognormvariate(0.0, 1.5) for _ in range(n)]
        assert percentile(values, 0.5) == statistics.median(values)


def test_percentile_matches_numpy_and_the_standard_library() -> None:
    numpy = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (2, 5, 30, 99, 200):
        values = [rng.expovariate(1 / 20.0) for _ in range(n)]
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        for q in (0.01, 0.25, 0.5, 0.9, 0.95, 0.99):
            expected = float(numpy.percentile(values, q * 100))  # (method "linear")
            assert percentile(values, q) == pytest.approx(expected, rel=1e-12)
            assert percentile(values, q) == pytest.approx(cuts[round(q * 100) - 1], rel=1e-12)


def test_percentile_refuses_what_it_cannot_answer() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be within \[0, 1\], got 99"):
        percentile([1.0, 2.0], 99)


def test_table_lays_out_rows_as_the_benchmarks_print_them() -> None:
    table = Table(20, (("fleet", 12), ("baseline", 12), ("ratio", 9)))
    assert table.header() == f"{'':<20}{'fleet':>12}{'baseline':>12}{'ratio':>9}"
    rate, base = 1550.4, 145.2
    # A cell is right-aligned to its column: "{x:.1f}x" in a 9 wide column is "{x:>8.1f}x".
    assert table.line("samples/s", f"{rate:.0f}", f"{base:.0f}", f"{rate / base:.1f}x") == (
        f"{'samples/s':<20}{rate:>12.0f}{base:>12.0f}{rate / base:>8.1f}x"
    )
    # Fewer cells than columns, and what follows the last cell as it is.
    assert table.line("p50 ms", "0.41", "0.39", tail=f"{0.02:>+8.2f}ms") == (
        f"{'p50 ms':<20}{'0.41':>12}{'0.39':>12}   +0.02ms"
    )
    # Neither a label nor a cell is ever cut.
    wide = "x" * 14
    assert table.line("a label longer than twenty", wide) == f"a label longer than twenty{wide}"
    with pytest.raises(ValueError, match="4 cells for 3 columns"):
        table.line("row", "1", "2", "3", "4")
    spaced = Table(6, (("a", 4), ("b", 4)), sep=" ")
    assert spaced.line("name", "1.5", "22") == "name    1.5   22"


def test_table_prints_header_and_rows(capsys: pytest.CaptureFixture[str]) -> None:
    table = Table(8, (("n", 5),))
    table.print_header()
    table.print_row("rows", "12")
    assert capsys.readouterr().out == "            n\nrows       12\n"


def test_the_json_line_rounds_top_level_floats_only(capsys: pytest.CaptureFixture[str]) -> None:
    results = {"rate_s": 1234.56789, "lost": 0, "gain": None, "ok": True, "sweep": [0.123456]}
    assert json.loads(json_line(results, 1)) == {
        "rate_s": 1234.6, "lost": 0, "gain": None, "ok": True, "sweep": [0.123456],
    }  # fmt: skip
    assert json_line(results) == json.dumps(results)
    print_json({"p50_ms": 0.123456}, 3)
    out = capsys.readouterr().out
    assert out == '{"p50_ms": 0.123}\n'


def test_stat_cpu_s_reads_user_and_system_ticks(tmp_path: Path) -> None:
    # A command name may hold spaces and parentheses: fields are counted after the last ")".
    stat = tmp_path / "stat"
    fields = ["S", "1", "1", "1", "0", "-1", "4194304", "0", "0", "0", "0", "250", "150"]
    stat.write_text(f"4242 (a (b) c) {' '.join(fields)} 0 0 20 0 1 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert stat_cpu_s(stat) == pytest.approx(400 / tick)
    # And this process's own file parses: a non-negative reading.
    assert stat_cpu_s(Path(f"/proc/{os.getpid()}/stat")) >= 0.0


def test_minimal_smolfile_as_a_warm_parent() -> None:
    cold = parse_smolfile(minimal_smolfile()).spec
    warm = parse_smolfile(minimal_smolfile(6)).spec
    assert cold.branch is None
    assert warm.branch is not None and warm.branch.enabled and warm.branch.pool_size == 6
    assert warm.image == cold.image == "minimal"
