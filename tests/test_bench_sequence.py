"""benchmarks/bench_sequence.py's pure helpers: the search for the longest length, the cap
test, the all-to-all formula and the report (no processes spawned)."""

from __future__ import annotations

import json

import pytest
from benchmarks import bench_sequence as bs
from benchmarks import common


def search(threshold: int, start: int = 4096, limit: int = 131072, resolution: int = 2048):
    calls: list[int] = []

    def fits(length: int) -> bool:
        calls.append(length)
        return length <= threshold

    longest, tried = bs.search_longest(fits, start, limit, 256, resolution)
    assert [n for n, _ in tried] == calls  # every probe recorded, in order
    assert all(n % 256 == 0 for n in calls)
    return longest, calls


def test_search_doubles_then_bisects_to_the_resolution() -> None:
    longest, calls = search(threshold=21000)
    assert calls[:4] == [4096, 8192, 16384, 32768]  # doubling until one fails
    assert 21000 - 2048 < longest <= 21000
    assert longest % 256 == 0


def test_search_stops_at_the_limit_when_everything_fits() -> None:
    assert search(threshold=10**9, limit=16384) == (16384, [4096, 8192, 16384])


def test_search_bisects_below_the_start_when_it_does_not_fit() -> None:
    longest, calls = search(threshold=1000, resolution=256)
    assert calls[0] == 4096 and longest == 768


def test_search_returns_zero_when_nothing_fits() -> None:
    longest, calls = search(threshold=0, resolution=256)
    assert longest == 0 and calls[-1] == 256


def test_all_to_all_formula_counts_query_key_value_and_output() -> None:
    # 4 tensors of B x S x H / sp fp32 elements per rank: 4 x 2 x 8192 x 128 / 4 x 4 bytes
    assert bs.a2a_formula_bytes(2, 8192, 128, 4) == 8 * 1024 * 1024
    assert bs.a2a_formula_bytes(1, 1024, 128, 2, elem=2) == 4 * 1024 * 64 * 2


def test_shared_length_is_the_longest_both_fit() -> None:
    assert bs.shared_length([12288, 30000], 256) == 12288
    assert bs.shared_length([256, 30000], 256) == 256
    assert bs.shared_length([0, 30000], 256) == 0


def result(seq_len: int, peaks: list[float], step_s: float = 2.0) -> dict:
    per_layer = bs.a2a_formula_bytes(1, seq_len, 128, 4)
    return {
        "seq_len": seq_len,
        "median_step_s": step_s,
        "step_times_s": [step_s],
        "peak_rss_mb": peaks,
        "baseline_rss_mb": [250.0] * 4,
        "page_faults_per_step": [None] * 4,
        "losses": [10.4, 10.39],
        "optimizer": "X",
        "bytes_per_step_by_rank": [
            {"a2a_forward": 16 * per_layer, "a2a_backward": 32 * per_layer, "all_payload": 1}
        ]
        * 4,
    }


def test_cap_counts_memory_above_each_ranks_baseline() -> None:
    done = result(1024, [750.0, 760.0, 740.0, 750.0])  # 500 + 510 + 490 + 500 above
    assert bs.above_baseline_mb(done) == [500.0, 510.0, 490.0, 500.0]
    assert bs.fits_cap(done, 2000.0)
    assert not bs.fits_cap(done, 1999.0)
    assert not bs.fits_cap({"error": "over the cap"}, 10**9)
    assert not bs.fits_cap(None, 10**9)


def test_report_shows_both_searches_and_bytes_against_the_formula(tmp_path) -> None:
    args = bs.parse_args(["--layers", "16"])
    searches = {
        "partita": {"longest": 16384, "tried": [[8192, True, {}], [16384, True, {}]]},
        "deepspeed": {"longest": 8192, "tried": [[8192, True, {}], [16384, False, {}]]},
    }
    rows = [
        common.Row(bs.label_of("partita"), result(8192, [1300.0] * 4, 1.0), is_peer=False),
        common.Row(bs.label_of("deepspeed"), result(8192, [2200.0] * 4, 2.0)),
    ]
    markdown = bs.render(args, searches, rows, 8192)
    assert "| 16384 | 2.00x |" in markdown
    assert "1.000x of 1 x formula" in markdown and "1.000x of 2 x formula" in markdown
    assert "0.50x" in markdown  # partita's step time against DeepSpeed's
    payload = {
        "args": {k: str(v) if hasattr(v, "parts") else v for k, v in vars(args).items()},
        "searches": searches,
        "shared_len": 8192,
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
    }  # fmt: skip
    md, js = common.write_results("sequence_test", markdown, payload, tmp_path)
    assert md.read_text() == markdown
    assert bs.rerender(json.loads(js.read_text())) == markdown  # --from_json


@pytest.mark.parametrize("quick", [False, True])
def test_arguments_give_lengths_that_divide_by_sp(quick: bool) -> None:
    args = bs.parse_args(["--quick"] if quick else [])
    assert args.multiple % args.sp == 0 and args.start_len % args.multiple == 0
