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

from server.bench.serve import launch

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


def lm_eval(tmp: Path, name: str, model: str, model_args: str) -> dict:
    """Run `lm_eval` on the task; its per-choice loglikelihoods by document, and its accuracy."""
    include, out = tmp / "tasks", tmp / name
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
    cmd += ["--include_path", str(include), "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob("samples_kiln_mc_*.jsonl")
    per_doc = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        per_doc[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]  # a string from some backends
    acc = json.loads(results.read_text())["results"]["kiln_mc"]["acc,none"]
    return {"acc": acc, "loglikelihoods": per_doc}


def test_lm_eval_through_kiln_equals_its_transformers_backend(smollm2_dir, tmp_path):
    flags = [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        str(256 << 20),
    ]
    with launch(smollm2_dir, flags, timeout=300) as (url, _):
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        kiln = lm_eval(tmp_path, "kiln", "local-completions", f"model={name},base_url={url}/v1/completions")
    hf = lm_eval(tmp_path, "hf", "hf", f"pretrained={smollm2_dir},dtype=float32")
    assert kiln["acc"] == hf["acc"] > 0.25  # better than chance on these questions
    assert kiln["loglikelihoods"].keys() == hf["loglikelihoods"].keys() and len(hf["loglikelihoods"]) == 16
    for doc, expected in hf["loglikelihoods"].items():
        assert kiln["loglikelihoods"][doc] == pytest.approx(expected, abs=1e-3), doc
