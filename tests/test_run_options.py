"""``run_options.check_output_path``: an output file may not be, or lie inside, one of the run's inputs."""

from __future__ import annotations

import json
import os

import pytest

from unified_models.cli import main
from unified_models.dsl import UnifiedModelsError
from unified_models.run_options import check_output_path


def test_an_output_is_refused_where_it_would_overwrite_an_input(tmp_path):
    model, prompts = tmp_path / "model", tmp_path / "p.jsonl"
    model.mkdir()
    (model / "config.json").write_text("{}")
    prompts.write_text('{"prompt": "hi"}\n')
    inputs = {"--model": model, "--prompts": prompts, "--tokenizer": None}
    with pytest.raises(UnifiedModelsError, match=r"--metrics .*p.jsonl is --prompts .*an input of this run"):
        check_output_path("--metrics", prompts, inputs)
    with pytest.raises(UnifiedModelsError, match=r"--json .*config.json lies inside --model"):
        check_output_path("--json", model / "config.json", inputs)
    with pytest.raises(UnifiedModelsError, match="lies inside --model"):
        check_output_path("--json", model / "new.json", inputs)  # not there yet: still inside the input
    link = tmp_path / "link.jsonl"
    os.symlink(prompts, link)
    with pytest.raises(UnifiedModelsError, match="is --prompts"):
        check_output_path("--metrics", link, inputs)  # a symlink to the input is the input
    check_output_path("--metrics", tmp_path / "m.jsonl", inputs)  # beside the inputs: fine
    check_output_path("--metrics", tmp_path / "m.jsonl")  # no inputs named


def test_check_refuses_a_report_over_its_models_config(tmp_path, capsys):
    """``check --json`` naming a file of ``--model`` is refused before anything runs; the model is intact."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["x"]}))
    assert main(["check", "--model", str(model), "--json", str(model / "config.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lies inside --model" in err and err.count("error:") == 1, err
    assert json.loads((model / "config.json").read_text()) == {"architectures": ["x"]}
