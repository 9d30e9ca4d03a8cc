"""``partita estimate``'s table as a reader sees it: a memory whose limit was not given is
"unchecked", never "fits", and each row's bytes per parameter are itemised so that they add up
to the row and can be read against the familiar 16 (2 weight + 2 gradient + 12 fp32 master and
Adam moments). No processes."""

from __future__ import annotations

import re

import pytest

from partita.estimate import Candidate, Hardware, ModelShape, candidates, estimate
from partita.estimate.cli import estimate_main

GB = 10**9
B7 = ModelShape.from_count(7 * GB, 7 * GB // 32)
_ROW = re.compile(r"^(z\d[^\n]*?)\s{2,}\S+ \w+\s+\S+ \w+\s+\S+ \w+\s{2}(.*)$")


def _verdicts(out: str) -> dict[str, str]:
    """{configuration label: verdict} from the table's rows."""
    rows = (_ROW.match(line) for line in out.splitlines())
    return {m.group(1).strip(): m.group(2) for m in rows if m}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = estimate_main(argv)
    return code, capsys.readouterr().out


def test_host_memory_not_given_is_unchecked_not_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """Optimizer offload puts 112 GB of a 7B model on the host; without --host_memory nothing
    is known about the host, so those rows say so and name the flag. Rows that use no host
    memory fit on the device limit given alone."""
    argv = ["--params", "7B", "--num_gpus", "8", "--device_memory", "80GB"]
    code, out = _run([*argv, "--checkpointing", "off"], capsys)
    assert code == 0
    verdicts = _verdicts(out)
    assert verdicts["z2 bf16"] == "fits", out
    for label in ("z1 opt=cpu bf16", "z3 opt=cpu bf16", "z3 opt=cpu param=cpu bf16"):
        assert verdicts[label] == "fits device; host unchecked (give --host_memory)", out
    assert "note: host memory not checked: --host_memory not given" in out
    # With the host limit given the same rows are judged on it.
    code, out = _run([*argv, "--checkpointing", "off", "--host_memory", "512GB"], capsys)
    assert _verdicts(out)["z1 opt=cpu bf16"] == "fits" and "not checked" not in out
    code, out = _run([*argv, "--checkpointing", "off", "--host_memory", "64GB"], capsys)
    assert _verdicts(out)["z1 opt=cpu bf16"].startswith("NO: host needs 112 GB per node")


def test_a_shortfall_still_names_what_was_not_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """With only --host_memory given, a row over it says NO and that the device went
    unchecked; CPU ranks hold everything in host memory, so only the host can be unchecked."""
    _, out = _run(["--params", "7B", "--checkpointing", "off", "--host_memory", "100GB"], capsys)
    verdicts = _verdicts(out)
    assert verdicts["z0 bf16"] == "device unchecked (give --device_memory)", out
    assert verdicts["z1 opt=cpu bf16"] == (
        "NO: host needs 112 GB per node, has 100 GB (8% kept free); "
        "device unchecked (give --device_memory)"
    )
    _, out = _run(["--params", "7B", "--checkpointing", "off", "--cpu", "--num_gpus", "2"], capsys)
    assert set(_verdicts(out).values()) == {"host unchecked (give --host_memory)"}, out


def test_unchecked_lists_only_memories_used_without_a_limit() -> None:
    e = estimate(B7, Candidate(2), Hardware(8, device_memory=80 * GB))
    assert e.unchecked() == [] and e.fits
    e = estimate(B7, Candidate(3, "cpu", "cpu"), Hardware(8, device_memory=80 * GB))
    assert e.unchecked() == ["host"] and e.fits
    e = estimate(B7, Candidate(3, "nvme", "nvme"), Hardware(8))
    assert e.unchecked() == ["device", "host", "nvme"]


@pytest.mark.parametrize("hw", [Hardware(1), Hardware(8), Hardware(2, accelerator="cpu")])
def test_bytes_per_param_items_add_up_to_the_row(hw: Hardware) -> None:
    """Each group's bytes per parameter, times the parameters, sum to the row's bytes per rank
    (device + host + NVMe): every item of the estimate is in exactly one group."""
    for c in candidates("bf16", False):
        e = estimate(B7, c, hw)
        per = e.per_param()
        groups = {k: v for k, v in per.items() if k != "total"}
        rank_bytes = e.device + (e.host_per_node + e.nvme_per_node) / hw.devices_per_node
        assert sum(groups.values()) * B7.trainable == pytest.approx(rank_bytes, rel=1e-9)
        assert per["total"] * B7.trainable == pytest.approx(rank_bytes, rel=1e-9)


def test_bytes_per_param_read_against_the_familiar_16() -> None:
    """One bf16 rank, nothing sharded: 2 weights + 2 gradients + 4 master + 8 moments is the
    familiar 16; partita's fp32 master gradients add 4 and the CUDA allocator's slack 10% of
    the rest, hence 22. Sharded over 8 ranks, stage 3 divides every state by 8."""
    per = estimate(B7, Candidate(0), Hardware(1)).per_param()
    assert (per["weights"], per["grads"], per["master"], per["moments"]) == (2, 6, 4, 8)
    assert per["slack"] == pytest.approx(0.1 * 20, rel=1e-6)
    assert per["total"] == pytest.approx(22, rel=1e-6)
    per = estimate(B7, Candidate(3, "cpu"), Hardware(8)).per_param()
    assert (per["weights"], per["grads"], per["master"], per["moments"]) == pytest.approx(
        (2 / 8, 4 / 8, 4 / 8, 8 / 8), rel=1e-6
    )


def test_each_row_prints_its_bytes_per_param_adding_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under every row a line ``bytes/param: weights 2.00 + ... = 22.00``: the printed parts
    add up to the printed total within their rounding (2 decimals each)."""
    _, out = _run(["--params", "7B", "--num_gpus", "2", "--checkpointing", "off"], capsys)
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("bytes/param:")]
    assert len(lines) == len(_verdicts(out)) > 0
    for line in lines:
        parts, total = line.removeprefix("bytes/param:").split("=")
        values = [float(p.split()[-1]) for p in parts.split("+")]
        names = [p.split()[0] for p in parts.split("+")]
        assert names[:4] == ["weights", "grads", "master", "moments"], line
        assert sum(values) == pytest.approx(float(total), abs=0.005 * (len(values) + 1)), line
    assert "The familiar 16 is 2 weights + 2 gradients + 4 fp32 master + 8 Adam moments" in out
