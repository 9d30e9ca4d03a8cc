"""ZeRO++ in ``partita estimate`` and ``partita plan``: the figures printed are
`partita.estimate.zeropp.price`'s for the same inputs, from flags or from a DeepSpeed config,
and on two nodes the planner takes the quantized plan the inter-node bytes favour, saying why,
or rejects it when the links cost nothing. In process (the CLIs' main with argv); no ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from partita.estimate import Candidate, Hardware, ModelShape, estimate
from partita.estimate.cli import estimate_main, plan_main
from partita.estimate.zeropp import ZeroPP, price

GB = 10**9
MACHINES = ["--params", "7B", "--num_gpus", "8", "--nodes", "2", "--checkpointing", "off"]
OPTS = ZeroPP(quantized_weights=True, quantized_gradients=True, error_feedback=True, hpz=8)
FLAGS = [
    "--zero_quantized_weights", "--zero_quantized_gradients",
    "--zero_quantized_gradients_error_feedback", "--zero_hpz_partition_size", "8",
]  # fmt: skip
_NUM = r"([\d,]+) B"


def _printed(out: str) -> dict[str, int]:
    """The figures of the ``zero++`` lines, by name, as integers."""
    found = {}
    for name, pattern in {
        "world": rf"gathers world {_NUM}",
        "gather_hpz": rf"\(inter\), hpz {_NUM} \(intra\); gradient",
        "reduce_hpz": rf"reductions hpz {_NUM}",
        "lane": rf"hpz_lane {_NUM}",
        "inter": rf"inter node {_NUM}",
        "intra": rf"intra node {_NUM}",
        "secondary": rf"hpZ secondary {_NUM}",
        "feedback": rf"error feedback {_NUM}",
        "buffers": rf"qgZ buffers {_NUM}",
    }.items():
        match = re.search(pattern, out)
        assert match, (name, out)
        found[name] = int(match.group(1).replace(",", ""))
    return found


def _expected() -> dict[str, int]:
    p = price(ModelShape.from_count(7 * GB).units, 16, OPTS, 2, 2)
    return {
        "world": p.gather[""],
        "gather_hpz": p.gather["hpz"],
        "reduce_hpz": p.reduce["hpz"],
        "lane": p.reduce["hpz_lane"],
        "inter": p.link_bytes("inter"),
        "intra": p.link_bytes("intra"),
        "secondary": p.secondary_bytes,
        "feedback": p.feedback_bytes,
        "buffers": p.transient_bytes,
    }


def test_estimate_prints_the_price_of_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Per rank and step by group and link, and the memory the options add: price()'s
    figures; the stage-3 rows with the options carry that memory as items."""
    assert estimate_main([*MACHINES, *FLAGS]) == 0
    out = capsys.readouterr().out
    assert "z3 bf16 qwZ hpZ8 qgZ8+ef " in out  # int8: qgZ's default width
    assert _printed(out) == _expected()
    model, hw = ModelShape.from_count(7 * GB), Hardware(8, 2)
    with_opts = estimate(model, Candidate(3, zeropp=OPTS), hw)
    without = estimate(model, Candidate(3), hw)
    added = {i.name: i.device for i in with_opts.items if i.name.startswith(("hpz", "qgz"))}
    want = _expected()
    assert added == {
        "hpz secondary": want["secondary"],
        "qgz feedback": want["feedback"],
        "qgz buffers": want["buffers"],
    }
    assert with_opts.device > without.device + sum(added.values())  # and its slack


def test_estimate_prices_a_ds_config_as_its_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    zero = {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_error_feedback": True,
        "zero_hpz_partition_size": 8,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    assert estimate_main([*MACHINES, "--ds_config", str(path)]) == 0
    assert _printed(capsys.readouterr().out) == _expected()
    path.write_text(json.dumps({"zero_optimization": zero | {"stage": 2}}))
    assert estimate_main([*MACHINES, "--ds_config", str(path)]) == 2
    assert "zero_optimization.zero_quantized_weights is priced at stage 3 only" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--zero_quantized_gradients"], "needs zero_hpz_partition_size > 1"),
        (["--zero_hpz_partition_size", "16"], "must divide the 8 devices per node"),
    ],
)
def test_bad_options_are_refused_naming_the_key(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert estimate_main([*MACHINES, *flags]) == 2
    assert message in capsys.readouterr().err


PLAN = [
    "--params", "30B", "--nodes", "2", "--num_gpus", "8", "--device_memory", "80GB",
    "--flops", "2e14", "--checkpointing", "on",
]  # fmt: skip


def test_on_two_nodes_the_planner_takes_the_plan_with_fewer_inter_node_bytes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """30B on 2 x 8 devices of 80 GB: only stage 3 without offload fits among the exact
    plans; at 25 GB/s across nodes its 180 GB per rank and step are the step's larger part,
    and qwZ + hpZ + qgZ (int8) cut the inter-node bytes about 5x: chosen, with the reason, and its
    keys written."""
    out_path = tmp_path / "ds.json"
    assert plan_main([*PLAN, "--output", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "chose z3 bf16 qwZ hpZ8 qgZ8;" in out, out
    reason = re.search(r"zero\+\+: chose .*inter-node bytes per rank and step ([\d,]+) "
                       r"against ([\d,]+)", out)  # fmt: skip
    assert reason, out
    ours, exact = (int(g.replace(",", "")) for g in reason.groups())
    units = ModelShape.from_count(30 * GB).units
    assert ours == price(units, 16, ZeroPP(True, True, hpz=8), 2, 2).link_bytes("inter")
    assert exact == price(units, 16, ZeroPP(), 2, 2).link_bytes("inter") > 5 * ours
    zero = json.loads(out_path.read_text())["zero_optimization"]
    assert zero["zero_quantized_weights"] and zero["zero_quantized_gradients"]
    assert zero["zero_hpz_partition_size"] == 8


def test_when_links_cost_nothing_the_quantized_plans_are_rejected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With links a million times faster the step is compute: no quantized plan gains the
    5% it must, so the exact plan is chosen and the line says why."""
    fast = ["--link_bandwidth", "1e17", "--inter_node_bandwidth", "1e17"]
    assert plan_main([*PLAN, *fast, "--output", str(tmp_path / "ds.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"zero\+\+: rejected z3 bf16 \S.*under the 5% a quantized plan", out), out
    assert "chose z3 bf16;" in out
    zero = json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]
    assert "zero_quantized_weights" not in zero


def test_on_one_node_the_planner_tries_no_zeropp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    one = [a if a != "2" else "1" for a in PLAN]
    plan_main([*one, "--output", str(tmp_path / "ds.json")])
    out = capsys.readouterr().out
    assert "zero++" not in out and "qwZ" not in out
