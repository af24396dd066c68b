"""The bench commands keep working (tiny sizes; no timing is asserted)."""

import json

from server.cli import main


def test_bench_scheduler(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "scheduler", "--num-requests", "16", "--steps", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["us_per_step"] > 0 and result["num_requests"] == 16


def test_bench_runner_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "runner", "--model", tiny_llama, "--batches", "1,3", "--context", "40", "--steps", "2",
                 "--prefill-len", "24", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for engine in ("kiln_compiled", "kiln_eager", "transformers"):
        assert set(result[engine]["decode_tok_s"]) == {"1", "3"} and result[engine]["prefill_tok_s"] > 0
    assert result["roofline_tok_s"] > 0
    assert "compiled / transformers" in capsys.readouterr().out


def test_bench_startup_on_a_tiny_model(tiny_chat_model, tmp_path):
    out = tmp_path / "st.json"
    assert main(["bench", "startup", "--model", tiny_chat_model, "--dtype", "float32",
                 "--engine-arg=--enforce-eager", "--engine-arg=--kv-cache-memory=50000000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["warm_s"] > 0 and result["cold_s"] > 0
