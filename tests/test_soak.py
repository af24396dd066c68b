"""The soak (`kiln bench soak`) in small: 64 misbehaving clients against one server, which must come back
whole. The full size (2,000 requests over 5 minutes, the default model compiled) is `make soak`."""

from server.bench import soak


def test_a_server_soaked_by_misbehaving_clients_comes_back_whole(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.setattr(soak, "SLOW_PAUSE_S", 0.2)  # still far slower than the tiny model's tokens come
    # With overlapped scheduling, whose steps in flight make aborts and disconnects the harder case.
    flags = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "50000000", "--async-scheduling"]
    result = soak.run(tiny_chat_model, flags, requests=70, duration_s=8, clients=64, log=tmp_path / "log")
    report = soak.format_report(result) + "\n" + (tmp_path / "log").read_text()[-3000:]
    assert result["ok"], report
    kinds = {outcome.split()[0] for outcome in result["outcomes"]}
    assert kinds == set(soak.KINDS), report
    outcomes = result["outcomes"]
    assert outcomes.get("burst 429", 0) > 0, report  # the limits refused some, with 429
    assert outcomes.get("drop dropped", 0) > 0 and outcomes.get("slow done", 0) > 0, report
    assert outcomes.get("abort client timeout", 0) > 0, report
    bad_4xx = sum(n for k, n in outcomes.items() if k.startswith("bad 4"))
    assert bad_4xx == outcomes_of(outcomes, "bad") > 0, report
    assert result["health"]["checks"] > 20, report


def outcomes_of(outcomes: dict[str, int], kind: str) -> int:
    return sum(n for k, n in outcomes.items() if k.split()[0] == kind)


def test_the_attack_bench_measures_good_clients_beside_every_attack(tiny_chat_model, tmp_path, monkeypatch):
    from server.bench import attack

    monkeypatch.setattr(attack, "SETTLE_S", 0.0)  # the memory after the attack is not checked here

    flags = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "50000000"]
    result = attack.run(tiny_chat_model, flags, duration_s=3, baseline_s=1, good=2, log=tmp_path / "log")
    report = attack.format_report(result) + "\n" + (tmp_path / "log").read_text()[-3000:]
    good = result["good"]
    assert good["alone"]["completed"] > 0 and good["attacked"]["completed"] > 0, report
    assert good["alone"]["failed"] == good["attacked"]["failed"] == 0, report
    assert {k.split()[0] for k in result["attacks"]} == set(attack.ATTACKS), report
    assert result["attacks"].get("browser 403", 0) > 0 and not any(
        k.startswith("browser 2") for k in result["attacks"]
    ), report
    assert not any(result["gauges_after"].values()) and len(result["gauges_after"]) == 3, report
