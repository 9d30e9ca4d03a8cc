"""Tests of partita.monitor: DeepSpeed's file layout and names, rank 0 only, W&B forwarding."""

from __future__ import annotations

import csv
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from partita.monitor import (
    EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS,
    EVENT_ELAPSED_BACKWARD_INNER_MS,
    EVENT_ELAPSED_BACKWARD_MS,
    EVENT_ELAPSED_FORWARD_MS,
    EVENT_ELAPSED_STEP_MS,
    EVENT_EVAL_LOSS,
    EVENT_LOSS_SCALE,
    EVENT_LR,
    EVENT_TRAIN_LOSS,
    build_monitor,
    eigenvalue_event,
)


def file_section(enabled: bool = True, output_path: Any = "", job_name: str = "job") -> Any:
    """A tensorboard/csv_monitor section as the config package would hand it over."""
    return SimpleNamespace(enabled=enabled, output_path=output_path, job_name=job_name)


def wandb_section(enabled: bool = True) -> Any:
    """A wandb section with every field set, so forwarding of each can be checked."""
    return SimpleNamespace(enabled=enabled, team="my-team", group="my-group", project="my-proj")


# Values exactly representable in float32 (TensorBoard stores scalars as float32), so read-back
# can be compared for equality.
EVENTS_STEP_8 = [(EVENT_TRAIN_LOSS, 2.5, 8), (EVENT_LR, 0.125, 8), (EVENT_LOSS_SCALE, 65536.0, 8)]
EVENTS_STEP_16 = [
    (EVENT_TRAIN_LOSS, 1.75, 16),
    (EVENT_LR, 0.0625, 16),
    (EVENT_LOSS_SCALE, 32768.0, 16),
]


def read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_event_names_are_deepspeeds() -> None:
    # These strings are the contract with existing dashboards; a rename must fail here.
    assert EVENT_TRAIN_LOSS == "Train/Samples/train_loss"
    assert EVENT_EVAL_LOSS == "Train/Samples/eval_loss"
    assert EVENT_LR == "Train/Samples/lr"
    assert EVENT_LOSS_SCALE == "Train/Samples/loss_scale"
    assert EVENT_ELAPSED_FORWARD_MS == "Train/Samples/elapsed_time_ms_forward"
    assert EVENT_ELAPSED_BACKWARD_MS == "Train/Samples/elapsed_time_ms_backward"
    assert EVENT_ELAPSED_BACKWARD_INNER_MS == "Train/Samples/elapsed_time_ms_backward_inner"
    assert EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS == "Train/Samples/elapsed_time_ms_backward_allreduce"
    assert EVENT_ELAPSED_STEP_MS == "Train/Samples/elapsed_time_ms_step"
    assert eigenvalue_event(3) == "Train/Eigenvalues/ModelBlockParam_3"


def test_csv_files_at_deepspeed_paths(tmp_path: Path) -> None:
    monitor = build_monitor(None, file_section(output_path=tmp_path), None, rank=0)
    assert monitor.enabled and monitor.is_writer
    monitor.write_events(EVENTS_STEP_8)
    monitor.write_events(EVENTS_STEP_16)
    monitor.close()

    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir()) == [
        "Train_Samples_loss_scale.csv",
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    assert read_csv(job / "Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["8", "0.125"],
        ["16", "0.0625"],
    ]
    assert read_csv(job / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"],
        ["8", "2.5"],
        ["16", "1.75"],
    ]
    # The csv module's "\r\n" row ending, as in DeepSpeed's files.
    assert (job / "Train_Samples_loss_scale.csv").read_bytes() == (
        b"step,loss_scale\r\n8,65536.0\r\n16,32768.0\r\n"
    )


def test_csv_rows_visible_before_close(tmp_path: Path) -> None:
    monitor = build_monitor(None, file_section(output_path=tmp_path), None, rank=0)
    monitor.write_events([(EVENT_LR, 0.5, 4)])
    assert read_csv(tmp_path / "job" / "Train_Samples_lr.csv") == [["step", "lr"], ["4", "0.5"]]
    monitor.close()


def test_csv_restart_appends_without_second_header(tmp_path: Path) -> None:
    for step, value in ((1, 0.5), (2, 0.25)):
        with build_monitor(None, file_section(output_path=tmp_path), None, rank=0) as monitor:
            monitor.write_events([(EVENT_LR, value, step)])
    assert read_csv(tmp_path / "job" / "Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["1", "0.5"],
        ["2", "0.25"],
    ]


def test_csv_name_sanitising_and_collision(tmp_path: Path) -> None:
    monitor = build_monitor(None, file_section(output_path=tmp_path), None, rank=0)
    monitor.write_events([("Eval/my metric", 3.0, 1), ("plain", 4.0, 1)])
    assert read_csv(tmp_path / "job" / "Eval_my_metric.csv") == [
        ["step", "my metric"],
        ["1", "3.0"],
    ]
    assert read_csv(tmp_path / "job" / "plain.csv") == [["step", "plain"], ["1", "4.0"]]
    # "Eval_my metric" maps to the same file as "Eval/my metric": refuse to mix two series.
    with pytest.raises(ValueError, match=r"'Eval/my metric' and 'Eval_my metric'"):
        monitor.write_events([("Eval_my metric", 5.0, 2)])
    monitor.close()


def test_default_output_path_is_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    section = file_section(output_path="", job_name="DeepSpeedJobName")
    with build_monitor(None, section, None, rank=0) as monitor:
        monitor.write_events([(EVENT_LR, 0.5, 1)])
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv").is_file()


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = build_monitor(file_section(output_path=str(tmp_path)), None, None, rank=0)
    monitor.write_events(EVENTS_STEP_8)
    monitor.write_events(EVENTS_STEP_16)
    monitor.close()

    job = tmp_path / "job"
    event_files = [p.name for p in job.iterdir()]
    assert len(event_files) == 1 and event_files[0].startswith("events.out.tfevents.")
    acc = EventAccumulator(str(job))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted([EVENT_LOSS_SCALE, EVENT_LR, EVENT_TRAIN_LOSS])
    expected = {
        EVENT_TRAIN_LOSS: [(8, 2.5), (16, 1.75)],
        EVENT_LR: [(8, 0.125), (16, 0.0625)],
        EVENT_LOSS_SCALE: [(8, 65536.0), (16, 32768.0)],
    }
    for tag, points in expected.items():
        assert [(s.step, s.value) for s in acc.Scalars(tag)] == points


def test_nonzero_rank_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_wandb(monkeypatch)
    monitor = build_monitor(
        file_section(output_path=tmp_path / "tb"),
        file_section(output_path=tmp_path / "csv"),
        wandb_section(),
        rank=1,
    )
    # Same config-level flag as rank 0 (safe to gate collectives on), but no writing.
    assert monitor.enabled and not monitor.is_writer
    assert monitor.backends == ()
    monitor.write_events(EVENTS_STEP_8)
    monitor.flush()
    monitor.close()
    assert list(tmp_path.iterdir()) == []
    assert fake.init_calls == [] and fake.logged == []


@pytest.mark.parametrize("sections", [(None, None, None), (False, False, False)])
def test_disabled_config_builds_disabled_monitor(
    tmp_path: Path, sections: tuple[Any, Any, Any]
) -> None:
    if sections[0] is False:
        sections = (
            file_section(enabled=False, output_path=tmp_path),
            file_section(enabled=False, output_path=tmp_path),
            wandb_section(enabled=False),
        )
    monitor = build_monitor(*sections, rank=0)
    assert not monitor.enabled and not monitor.is_writer
    monitor.write_events(EVENTS_STEP_8)
    monitor.close()
    assert list(tmp_path.iterdir()) == []


class FakeRun:
    """Stands in for a wandb Run: records log calls into its module's list."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.finished = False

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.module.logged.append((dict(data), step))

    def finish(self) -> None:
        self.finished = True


def install_fake_wandb(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake: Any = types.ModuleType("wandb")
    fake.run = None
    fake.init_calls = []
    fake.logged = []

    def init(**kwargs: Any) -> FakeRun:
        fake.init_calls.append(kwargs)
        fake.run = FakeRun(fake)
        return fake.run

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_wandb_forwarding_with_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_wandb(monkeypatch)
    monitor = build_monitor(None, None, wandb_section(), rank=0)
    assert monitor.enabled and monitor.backends == ("WandbSink",)
    assert fake.init_calls == [{"project": "my-proj", "group": "my-group", "entity": "my-team"}]
    monitor.write_events(EVENTS_STEP_8 + [(EVENT_LR, 0.25, 8)] + EVENTS_STEP_16[:1])
    # Same-step events share one call; a repeated name at the same step starts a new one.
    assert fake.logged == [
        ({EVENT_TRAIN_LOSS: 2.5, EVENT_LR: 0.125, EVENT_LOSS_SCALE: 65536.0}, 8),
        ({EVENT_LR: 0.25}, 8),
        ({EVENT_TRAIN_LOSS: 1.75}, 16),
    ]
    run = fake.run
    monitor.close()
    assert run.finished


def test_wandb_reuses_and_keeps_users_run(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_wandb(monkeypatch)
    users_run = FakeRun(fake)
    fake.run = users_run
    with build_monitor(None, None, wandb_section(), rank=0) as monitor:
        monitor.write_events([(EVENT_LR, 0.5, 3)])
    assert fake.init_calls == []
    assert fake.logged == [({EVENT_LR: 0.5}, 3)]
    assert not users_run.finished


@pytest.mark.parametrize("rank", [0, 2])
def test_wandb_missing_package_error(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ImportError, match=rf"wandb\.enabled.*rank {rank}.*pip install wandb"):
        build_monitor(None, None, wandb_section(), rank=rank)


def test_tensorboard_missing_package_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"tensorboard\.enabled.*pip install tensorboard"):
        build_monitor(file_section(output_path=tmp_path), None, None, rank=0)
    assert list(tmp_path.iterdir()) == []


def test_event_validation_and_coercion(tmp_path: Path) -> None:
    import torch

    monitor = build_monitor(None, file_section(output_path=tmp_path), None, rank=0)
    monitor.write_events([(EVENT_TRAIN_LOSS, torch.tensor(0.5), torch.tensor(4))])
    assert read_csv(tmp_path / "job" / "Train_Samples_train_loss.csv")[1] == ["4", "0.5"]
    with pytest.raises(ValueError, match=r"#0 \('Train/Samples/lr'\): value must be a real"):
        monitor.write_events([(EVENT_LR, cast(Any, "high"), 1)])
    with pytest.raises(ValueError, match=r"#1 \('Train/Samples/lr'\): step must be an integer"):
        monitor.write_events([(EVENT_LR, 0.5, 1), (EVENT_LR, 0.5, cast(Any, 1.5))])
    with pytest.raises(ValueError, match=r"#0 must be a \(name, value, step\) tuple"):
        monitor.write_events([cast(Any, (EVENT_LR, 0.5))])
    monitor.close()
    monitor.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed Monitor"):
        monitor.write_events([(EVENT_LR, 0.5, 2)])


def test_rank_must_be_non_negative_int() -> None:
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        build_monitor(None, None, None, rank=-1)
