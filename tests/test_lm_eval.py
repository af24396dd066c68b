"""lm-evaluation-harness itself against a live `kiln serve`: a multiple-choice task shipped in
tests/lm_eval_task, scored through the completions API (echo with logprobs), equal to lm-eval's own
transformers backend on the same model in float32."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_server import AUTH, KEY

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = """task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def lm_eval(
    tmp: Path, name: str, model: str, model_args: str, extra_env: dict | None = None
) -> subprocess.Popen:
    """Start `lm_eval` on the task, its results under tmp / name (read by `results`)."""
    include = tmp / "tasks"
    include.mkdir(exist_ok=True)
    (include / "kiln_mc.yaml").write_text(TASK.format(data=TASK_DIR / "kiln_mc.jsonl"))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "kiln_mc",
    ]
    cmd += [
        "--include_path",
        str(include),
        "--batch_size",
        "1",
        "--output_path",
        str(tmp / name),
        "--log_samples",
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.log").open("w"), env=env | (extra_env or {})
    )


def results(run: subprocess.Popen, out: Path) -> dict:
    """A finished `lm_eval` run's per-choice loglikelihoods by document, and its accuracy."""
    assert run.wait(timeout=600) == 0, (out.parent / f"{out.name}.log").read_text()[-5000:]
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob("samples_kiln_mc_*.jsonl")
    per_doc = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        per_doc[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]  # a string from some backends
    acc = json.loads(results.read_text())["results"]["kiln_mc"]["acc,none"]
    return {"acc": acc, "loglikelihoods": per_doc}


def test_lm_eval_through_kiln_equals_its_transformers_backend(server, smollm2_dir, tmp_path):
    """Against the session's server (the default model in float32, eager); transformers' run meanwhile,
    in its own process."""
    hf_run = lm_eval(tmp_path, "hf", "hf", f"pretrained={smollm2_dir},dtype=float32")
    name = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    args = f"model={name},base_url={server.url}/v1/completions,tokenizer={smollm2_dir}"
    kiln = results(
        lm_eval(tmp_path, "kiln", "local-completions", args, {"OPENAI_API_KEY": KEY}), tmp_path / "kiln"
    )
    hf = results(hf_run, tmp_path / "hf")
    assert kiln["acc"] == hf["acc"] > 0.25  # better than chance on these questions
    assert kiln["loglikelihoods"].keys() == hf["loglikelihoods"].keys() and len(hf["loglikelihoods"]) == 16
    for doc, expected in hf["loglikelihoods"].items():
        assert kiln["loglikelihoods"][doc] == pytest.approx(expected, abs=1e-3), doc
