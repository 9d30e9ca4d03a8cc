"""``partita generate`` on a model folder without tokenizer files: the error says what to pass
(``--tokenizer DIR`` or ``--prompt_ids 1,2,3``) and names the folder it looked in;
``--tokenizer`` takes a tokenizer folder, ``--prompt_ids`` needs none. The tiny tokenizer is
built here (a word-level ``PreTrainedTokenizerFast``); nothing is downloaded. Ranks run in this
process (one rank), as in ``test_inference_tp.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import inference_workers as w


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A model folder with no tokenizer files and a folder holding only a tokenizer."""
    model = str(tmp_path_factory.mktemp("bare-model"))
    w.save_family("llama", model)
    tokenizer = str(tmp_path_factory.mktemp("tokenizer"))
    w.save_tokenizer(tokenizer)
    return {"model": model, "tokenizer": tokenizer}


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from partita.launcher.cli import main

    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _greedy(model: str, ids: torch.Tensor, new: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    return hf.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)


def test_no_tokenizer_says_what_to_pass_and_where_it_looked(
    folders: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    model = folders["model"]
    err = _bad(["--model", model, "--prompt", "w5 w6"], capsys)
    assert "no tokenizer files (tokenizer.json, tokenizer_config.json" in err
    assert f"in {os.path.abspath(model)}" in err
    assert "--tokenizer DIR" in err and "--prompt_ids 1,2,3" in err


def test_a_bad_tokenizer_or_prompt_ids_is_one_line_naming_it(
    folders: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = folders["model"]
    missing = str(tmp_path / "missing")
    err = _bad(["--model", model, "--tokenizer", missing, "--prompt", "x"], capsys)
    assert f"--tokenizer {missing}: no such folder" in err
    err = _bad(["--model", model, "--tokenizer", str(tmp_path), "--prompt", "x"], capsys)
    assert f"--tokenizer {tmp_path}: no tokenizer files" in err
    err = _bad(["--model", model, "--prompt_ids", "1,x,3"], capsys)
    assert "--prompt_ids '1,x,3': 'x' is not a token id" in err
    err = _bad(["--model", model, "--prompt_ids", "1,128"], capsys)  # the tiny vocab is 128
    assert "token id 128 is outside the model's vocabulary of 128" in err


def _launched_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """What ``partita generate`` would hand each rank (the launch itself replaced)."""
    import partita.launcher.launch as launch_mod
    from partita.inference.cli import main

    seen: list[Any] = []
    monkeypatch.setattr(launch_mod, "launch", lambda options: seen.append(options) or 0)
    assert main(argv) == 0
    return tuple(seen[0].script_args)


def test_tokenizer_folder_is_handed_to_the_ranks_and_decodes(
    folders: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--tokenizer DIR`` (relative here) reaches the ranks as an absolute folder; the rank
    prints the one-process model's greedy continuation decoded by it."""
    from transformers import AutoTokenizer

    from partita.inference.cli import rank_main

    monkeypatch.chdir(os.path.dirname(folders["tokenizer"]))
    relative = os.path.basename(folders["tokenizer"])
    prompt = "w5 w17 w42"
    argv = ["--model", folders["model"], "--tokenizer", relative, "--prompt", prompt]
    args = _launched_args([*argv, "--max_new_tokens", "4"], monkeypatch)
    assert args[args.index("--tokenizer") + 1] == folders["tokenizer"]
    assert rank_main(list(args)) == 0
    text = capsys.readouterr().out.strip().splitlines()[-2]
    tok = AutoTokenizer.from_pretrained(folders["tokenizer"])
    ids = tok(prompt, return_tensors="pt").input_ids
    assert text == tok.decode(_greedy(folders["model"], ids, 4)[0], skip_special_tokens=True)


def test_prompt_ids_need_no_tokenizer_and_print_ids(
    folders: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from partita.inference.cli import rank_main

    argv = ["--model", folders["model"], "--prompt_ids", "5, 17,42", "--max_new_tokens", "4"]
    args = _launched_args(argv, monkeypatch)
    assert "--tokenizer" not in args
    assert rank_main(list(args)) == 0
    printed, speed = capsys.readouterr().out.strip().splitlines()[-2:]
    expected = _greedy(folders["model"], torch.tensor([[5, 17, 42]]), 4)[0]
    assert printed == ",".join(str(int(t)) for t in expected)
    assert "4 new tokens" in speed
