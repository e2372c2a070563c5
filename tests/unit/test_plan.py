"""`tandem profile`'s fits and `tandem plan`'s mixes, recommendation, table and Helm values."""

from __future__ import annotations

import json

import pytest
import yaml

from tandem.planner import profile as profile_mod
from tandem.planner.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel, attention_pairs
from tandem.planner.mix import Mix, all_mixes, helm_values
from tandem.planner.cpu_share import Hardware
from tandem.planner.prediction import recommend
from tandem.planner.plan_validate import error
from tandem.cli.main import main as cli


def test_prefill_fit_recovers_linear_and_attention_costs():
    true = PrefillModel(0.01, 5e-4, 2e-7)
    pts = [{"tokens": b * n, "seqs": b, "pairs": b * attention_pairs(n), "seconds": true(b * n, b * attention_pairs(n))}
           for n, b in ((16, 1), (128, 1), (512, 1), (1024, 1), (256, 4), (128, 8))]
    fit = PrefillModel.fit(pts)
    assert fit.base == pytest.approx(0.01, rel=1e-6)
    assert fit.per_token == pytest.approx(5e-4, rel=1e-6)
    assert fit.per_pair == pytest.approx(2e-7, rel=1e-6)
    # one long prompt costs more than the same tokens in four short ones (attention)
    assert fit(1024) > fit(1024, 4 * attention_pairs(256))
    assert fit(0) == 0.0


def test_fits_take_medians_and_never_go_negative():
    pts = [{"batch": b, "context": c, "seconds": 0.005 + 0.001 * b + 1e-6 * c + noise}
           for b, c in ((1, 100), (4, 400), (16, 1600), (16, 8000), (32, 3200)) for noise in (0.0, 0.0, 5.0)]
    fit = DecodeModel.fit(pts)  # the one outlier per point is out-voted by the median
    assert (fit.base, fit.per_seq, fit.per_ctx) == pytest.approx((0.005, 0.001, 1e-6), rel=1e-6)
    falling = [{"tokens": t, "pairs": attention_pairs(t), "seconds": s}
               for t, s in ((16, 0.3), (64, 0.2), (256, 0.25), (1024, 0.9))]
    f = PrefillModel.fit(falling)
    assert min(f.base, f.per_token, f.per_pair) >= 0.0


def test_transfer_fit_is_latency_plus_bandwidth():
    pts = [{"bytes": b, "seconds": 0.002 + b / 1e9} for b in (2**18, 2**20, 2**24)]
    t = TransferModel.fit(pts)
    assert t.latency == pytest.approx(0.002, rel=1e-6)
    assert t.bytes_per_s == pytest.approx(1e9, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        TransferModel.fit(pts[:1])
    flat = TransferModel.fit([{"bytes": 2**18, "seconds": 0.03}, {"bytes": 2**24, "seconds": 0.02}])
    assert flat.seconds_per_byte == 0.0 and flat(2**24) == pytest.approx(0.025)  # noise: latency only


def test_mixes_parse_and_enumerate():
    assert Mix.parse("2P+1D") == Mix(2, 1)
    assert Mix.parse("colocatedx3") == Mix.parse("colocated×3") == Mix(0, 3, True)
    assert Mix(2, 1).label == "2P+1D" and Mix(2, 1).workers == 3 and Mix(2, 1).mode == "disaggregated"
    cond = Mix.parse("2P+1D-conditional")
    assert cond == Mix(2, 1, conditional=True) and cond.label == "2P+1D-conditional" and cond.workers == 3
    assert cond.mode == "conditional" and Mix(0, 3, True).mode == "colocated"
    for bad in ("0P+1D", "2P", "colocated0", "3", "0P+1D-conditional", "colocatedx2-conditional", "2P+1Dc"):
        with pytest.raises(ValueError, match="xP\\+yD"):
            Mix.parse(bad)
    with pytest.raises(ValueError, match="not both"):
        Mix(0, 2, colocated=True, conditional=True)
    mixes = all_mixes(3)
    assert [m.label for m in mixes] == ["colocated×1", "1P+1D", "1P+1D-conditional", "colocated×2", "2P+1D",
                                        "2P+1D-conditional", "1P+2D", "1P+2D-conditional", "colocated×3"]
    assert all(Mix.parse(m.label) == m for m in mixes)


def _result(label: str, cores: int, attainment_at: dict[float, float], good: float) -> dict:
    return {"label": label, "cores": cores, "goodput": {"interpolated_rps": good},
            "runs": [{"rate": r, "summary": {"attainment": {"both": a}}} for r, a in attainment_at.items()]}


def test_recommend_picks_the_cheapest_mix_meeting_the_slo():
    results = [_result("colocated×1", 1, {3.0: 0.5}, 1.0),
               _result("1P+1D", 2, {3.0: 0.91}, 3.2),
               _result("colocated×2", 2, {3.0: 0.95}, 3.6),  # same cost, more goodput: wins the tie
               _result("2P+1D", 3, {3.0: 1.0}, 5.0)]
    assert recommend(results, 3.0, 0.9)["label"] == "colocated×2"
    assert recommend(results, 3.0, 0.99)["label"] == "2P+1D"
    assert recommend(results[:1], 3.0, 0.9) is None
    tie = [_result("1P+1D", 2, {3.0: 0.92}, 3.0), _result("colocated×2", 2, {3.0: 0.97}, 3.0)]
    assert recommend(tie, 3.0, 0.9)["label"] == "colocated×2"  # same cost and goodput: more attainment


def test_helm_values_set_the_worker_groups():
    disagg = yaml.safe_load(helm_values(Mix(2, 1), "note"))
    assert disagg == {"gateway": {"mode": "disaggregated"}, "prefill": {"replicas": 2, "workersPerPod": 1},
                      "decode": {"replicas": 1, "workersPerPod": 1}}
    colo = yaml.safe_load(helm_values(Mix(0, 3, True), "note"))
    assert colo["gateway"]["mode"] == "colocated"
    cond = yaml.safe_load(helm_values(Mix(2, 1, conditional=True), "note"))
    assert cond == {**disagg, "gateway": {"mode": "conditional"}}
    assert yaml.safe_load(helm_values(Mix(2, 1), "note", local_prefill_threshold=200)) == disagg
    lower = yaml.safe_load(helm_values(Mix(2, 1, conditional=True), "note", local_prefill_threshold=200))
    assert lower["gateway"] == {"mode": "conditional", "extraArgs": ["--local-prefill-threshold", "200"]}
    both = yaml.safe_load(helm_values(Mix(2, 1, conditional=True), "note", local_prefill_threshold=200,
                                      prefill_saturation_s=2.5))
    assert both["gateway"]["extraArgs"] == ["--local-prefill-threshold", "200",
                                            "--prefill-saturation-s", "2.5"]
    assert (colo["prefill"]["replicas"], colo["decode"]["replicas"]) == (0, 3)
    # CPU workers: each pod requests the planned threads, which its worker runs
    sized = yaml.safe_load(helm_values(Mix(2, 1), "note", threads=2))
    for group in ("prefill", "decode"):
        assert sized[group] == {**disagg[group], "resources": {"requests": {"cpu": "2"}}}


def test_step_factors_set_served_step_cpu_against_the_profiled_cost_of_the_same_steps():
    from tandem.planner.plan_validate import step_factors

    model = StepModel(PrefillModel(0.02, 0.0, 0.0), DecodeModel(0.01, 0.0, 0.0))
    simulated = {"prefill": {"steps": 10, "prefill_s": 2.0, "decode_s": 0.0},
                 "decode": {"steps": 100, "prefill_s": 0.0, "decode_s": 3.0}}
    # decode ran 20 more steps than simulated: 20 more fixed costs expected (3.2 s)
    measured = {"prefill": (2.4, 10.0), "decode": (4.0, 120.0)}
    assert step_factors(measured, simulated, model, (1.0, 1.0)) == {"prefill": pytest.approx(1.2),
                                                                    "decode": pytest.approx(1.25)}
    assert step_factors({"decode": (1.0, 0.0)}, simulated, model, (1.0, 1.0)) == {}  # no steps: no factor
    # colocated steps do both: their CPU scales the default split (1.0 prompt, 2.0 decode);
    # expected at the defaults 1.0 * 1.0 + 2.0 * (2.0 + 10 * 0.01) = 5.2 s, measured 6.5
    both = {"both": {"steps": 50, "prefill_s": 1.0, "decode_s": 2.0}}
    assert step_factors({"both": (6.5, 60.0)}, both, model, (1.0, 2.0)) == {"prefill": pytest.approx(1.25),
                                                                            "decode": pytest.approx(2.5)}


def test_prediction_error():
    assert error(1.1, 1.0) == pytest.approx(0.1)
    assert error(1.0, 0.0) is None


def _prefill_points(per_token: float = 4e-4) -> list[dict]:
    return [{"tokens": n, "seqs": 1, "pairs": attention_pairs(n), "seconds": 0.01 + per_token * n}
            for n in (16, 256, 1024)]


def _decode_points(per_seq: float = 0.001) -> list[dict]:
    return [{"batch": b, "context": c, "seconds": 0.01 + per_seq * b} for b, c in ((1, 64), (8, 512), (32, 64))]


def _profile(path, transfer: bool = True, device: str = "cpu", burst_threads: int = 0) -> str:
    pts = {"prefill": _prefill_points(), "decode": _decode_points(), "mixed": [],
           "transfer": [{"bytes": b, "seconds": 1e-3 + b / 1e9} for b in (2**20, 2**24)] if transfer else []}
    if burst_threads:  # bursting: prompts twice as fast, decode steps a little faster
        pts["burst"] = {"threads": burst_threads, "prefill": _prefill_points(2e-4), "decode": _decode_points(8e-4),
                        "local_prefill": _prefill_points(2e-4)}
    prof = profile_mod.fit({
        "schema": profile_mod.SCHEMA, "hardware": {"cpu": "test CPU", "cores": 4, "device": device},
        "model": {"path": "unused"}, "worker": {"threads_per_worker": 1, "prefill_nice": 0},
        "engine": {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16, "num_blocks": 4096,
                   "kv_bytes_per_token": 16384}, "points": pts})
    path.write_text(json.dumps(prof))
    return str(path)


def test_tandem_plan_prints_the_table_and_writes_helm_values(tmp_path, capsys):
    prof = _profile(tmp_path / "profile.json")
    values = tmp_path / "values.yaml"
    code = cli(["plan", "--profile", prof, "--preset", "interference", "--num-prompts", "20", "--rates", "1,2",
                "--repeats", "1", "--mixes", "1P+1D,1P+1D-conditional,colocatedx2", "--helm-values", str(values),
                "--no-plots", "--out-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1P+1D" in out and "1P+1D-conditional" in out and "colocated×2" in out and "recommended:" in out
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["recommended"] in ("1P+1D", "1P+1D-conditional", "colocated×2")
    assert [r["label"] for r in plan["results"]] == ["1P+1D", "1P+1D-conditional", "colocated×2"]
    assert all(len(r["runs"]) == 2 for r in plan["results"])
    chosen = Mix.parse(plan["recommended"].replace("×", "x"))
    written = yaml.safe_load(values.read_text())
    assert written["decode"]["replicas"] == chosen.decode and written["gateway"]["mode"] == chosen.mode
    assert written["decode"]["resources"] == {"requests": {"cpu": "1"}}  # the profile's 1 thread


def test_tandem_plan_takes_the_request_path_measured_on_this_host(tmp_path, capsys):
    prof = _profile(tmp_path / "profile.json")
    path = tmp_path / "path.json"
    path.write_text(json.dumps({"idle_cores": 0.25, "per_step_s": 0.004, "per_token_s": 0.0007}))
    common = ["plan", "--profile", prof, "--preset", "chat", "--num-prompts", "10", "--rates", "2", "--repeats",
              "1", "--mixes", "1P+1D", "--no-plots"]
    assert cli([*common, "--request-path", str(path), "--out-dir", str(tmp_path / "a")]) in (0, 1)
    hw = json.loads((tmp_path / "a" / "plan.json").read_text())["hardware"]
    assert (hw["server_idle_cores"], hw["frontend_s_per_step"], hw["frontend_s_per_token"]) == (0.25, 0.004, 0.0007)
    assert cli([*common, "--out-dir", str(tmp_path / "b")]) in (0, 1)  # without it: the flags' defaults
    hw = json.loads((tmp_path / "b" / "plan.json").read_text())["hardware"]
    assert (hw["server_idle_cores"], hw["frontend_s_per_step"], hw["frontend_s_per_token"]) == \
        pytest.approx((0.08, 0.0049, 0.00042))
    capsys.readouterr()


def test_pools_burst_as_tandem_serve_sizes_them_where_the_profile_timed_it():
    hw = Hardware(2, 1)
    one_each = Mix(1, 1).bursts(hw, 2)
    assert (one_each.prefill_burst_threads, one_each.decode_burst_threads) == (2, 2)
    two_prefill = Mix(2, 1, conditional=True).bursts(hw, 2)  # 2 // 2 = 1 thread: no burst
    assert (two_prefill.prefill_burst_threads, two_prefill.decode_burst_threads) == (0, 2)
    for mix, profiled in ((Mix(0, 2, colocated=True), 2), (Mix(1, 1), 0)):
        none = mix.bursts(hw, profiled)
        assert (none.prefill_burst_threads, none.decode_burst_threads) == (0, 0)
    wide = Hardware(8, 2)  # 1P+1D: 8 threads each; 2P+2D: 4, which this profile did not time
    assert Mix(1, 1).bursts(wide, 8).decode_burst_threads == 8
    assert Mix(2, 2).bursts(wide, 8).decode_burst_threads == 0


def test_tandem_plan_models_bursts_from_the_profile_unless_off_or_for_the_chart(tmp_path, capsys):
    prof = _profile(tmp_path / "profile.json", burst_threads=4)  # the profile's 4 cores
    common = ["plan", "--profile", prof, "--preset", "chat", "--num-prompts", "10", "--rates", "1", "--repeats",
              "1", "--mixes", "1P+1D,2P+1D,colocatedx2", "--no-plots"]

    def planned(*extra: str) -> list[dict]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert cli([*common, *extra, "--out-dir", str(out)]) in (0, 1)
        return json.loads((out / "plan.json").read_text())["results"]

    bursting = planned()
    assert [r["bursts"] for r in bursting] == [{"prefill": 4, "decode": 4}, {"prefill": 0, "decode": 4},
                                               {"prefill": 0, "decode": 0}]
    assert "bursts to 4 threads" in capsys.readouterr().out
    for extra in (("--bursts", "off"), ("--helm-values", str(tmp_path / "values.yaml"))):
        fixed = planned(*extra)
        assert all(r["bursts"] == {"prefill": 0, "decode": 0} for r in fixed)
        ttft = [r["runs"][0]["summary"]["ttft_ms"]["p50"] for r in (bursting[0], fixed[0])]
        assert ttft[0] < ttft[1]  # 1P+1D: a lone prompt prefills at the burst cost
        assert bursting[2]["runs"] == fixed[2]["runs"]  # colocated: the same either way
    capsys.readouterr()


def test_tandem_plan_says_when_no_mix_meets_the_slo(tmp_path, capsys):
    prof = _profile(tmp_path / "profile.json")
    code = cli(["plan", "--profile", prof, "--preset", "chat", "--num-prompts", "10", "--rates", "2",
                "--repeats", "1", "--mixes", "colocatedx1", "--slo-ttft-ms", "1", "--no-plots",
                "--out-dir", str(tmp_path / "out")])
    assert code == 1
    assert "no mix" in capsys.readouterr().out


def test_tandem_plan_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli(["plan", "--profile", str(bad), "--preset", "chat", "--no-plots"]) == 2
    assert "not a tandem profile" in capsys.readouterr().err
    no_transfer = _profile(tmp_path / "p.json", transfer=False)
    assert cli(["plan", "--profile", no_transfer, "--preset", "chat", "--mixes", "1P+1D", "--no-plots",
                "--out-dir", str(tmp_path / "o")]) == 2
    assert "no KV transfer part" in capsys.readouterr().err
    assert cli(["plan", "--profile", no_transfer, "--preset", "chat", "--mixes", "2Q", "--no-plots"]) == 2


@pytest.mark.parametrize("others", [0.0, 0.5])
def test_background_sampler_is_not_biased_by_counters_that_tick_apart(monkeypatch, others):
    """Our process busy on one core, its own counter read half a tick early and late in
    turn against /proc/stat's: the intervals that credit our CPU to others and those that
    take it back must cancel, not leave a share of our core counted as background."""
    import types

    from tandem.bench import cpu_load

    clock = {"t": 0.0, "busy": 0.0, "ours": 0.0, "n": 0}

    def tick() -> None:  # one second: we use 1 core, others ``others``
        clock["t"] += 1.0
        clock["busy"] += 1.0 + others
        clock["n"] += 1
        clock["ours"] = clock["n"] - 0.5 * (clock["n"] % 2)  # our counter lags every other read

    monkeypatch.setattr(cpu_load, "time", types.SimpleNamespace(monotonic=lambda: clock["t"]))
    monkeypatch.setattr(cpu_load, "busy_cpu_seconds", lambda: clock["busy"])
    monkeypatch.setattr(cpu_load, "process_cpu_seconds", lambda pid: clock["ours"])
    monkeypatch.setattr(cpu_load, "process_tree", lambda roots: {1})
    sampler = cpu_load.BackgroundSampler(roots=lambda: [1])
    sampler.sample()
    for _ in range(9):
        tick()
        sampler.sample()
    tick()
    assert sampler.stop() == pytest.approx(others)  # never started: stop() takes the last sample
    assert len(sampler.samples) == 10


class _FakeProc:
    """/proc as ``tandem.bench.cpu_load`` reads it, set by the test: the clock, the CPU
    seconds all CPUs have been busy, and each live process's CPU seconds and parent."""

    def __init__(self, monkeypatch) -> None:
        from types import SimpleNamespace

        from tandem.bench import cpu_load

        self.now, self.busy, self.cpu, self.parent = 0.0, 0.0, {}, {}
        monkeypatch.setattr(cpu_load, "time", SimpleNamespace(monotonic=lambda: self.now,
                                                              sleep=lambda s: self.advance(s)))
        monkeypatch.setattr(cpu_load, "busy_cpu_seconds", lambda: self.busy)
        monkeypatch.setattr(cpu_load, "process_cpu_seconds", lambda pid: self.cpu.get(pid))
        monkeypatch.setattr(cpu_load, "_children", self.children)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for pid in self.cpu:
            kids.setdefault(self.parent.get(pid, 0), []).append(pid)
        return kids

    def advance(self, dt: float, *, others: float = 0.0, **cores: float) -> None:
        """``dt`` seconds pass: process ``p<pid>`` busy ``cores["p<pid>"]`` cores, other
        processes (outside any tree) ``others`` cores."""
        self.now += dt
        for name, c in cores.items():
            self.cpu[int(name[1:])] += c * dt
        self.busy += (others + sum(cores.values())) * dt


def test_background_sampler_counts_other_processes_cpu_not_ours(monkeypatch):
    import os

    from tandem.bench.cpu_load import BackgroundSampler, busy_cpu_seconds, process_cpu_seconds

    proc = _FakeProc(monkeypatch)
    proc.cpu = {10: 0.0, 20: 0.0}  # ours (10) and a process of someone else's (20)
    sampler = BackgroundSampler(lambda: [10], interval_s=1.0)
    sampler.sample()  # the first sample only starts
    proc.advance(1.0, p10=1.0, p20=0.5, others=0.25)  # our busy thread is left out, theirs counted
    sampler.sample()
    proc.cpu[11], proc.parent[11] = 5.0, 10  # a child of ours: from the first sample that sees it
    proc.advance(1.0, p10=1.0, p20=0.5, others=0.25)
    sampler.sample()
    proc.advance(1.0, p10=0.5, p11=1.0, p20=0.5, others=0.25)
    sampler.sample()
    proc.advance(1.0, p10=1.0, p20=0.5, others=2.25)
    del proc.cpu[11]  # our child ended
    assert sampler.stop() == pytest.approx((3 * 0.75 + 2.75) / 4)
    assert sampler.samples == pytest.approx([0.75, 0.75, 0.75, 2.75])
    # the mean is clamped: fewer busy seconds than ours (a counter lag) is no background
    proc2 = _FakeProc(monkeypatch)
    proc2.cpu = {10: 0.0}
    lagging = BackgroundSampler(lambda: [10], interval_s=1.0)
    lagging.sample()
    proc2.advance(1.0, p10=1.0)
    proc2.busy -= 0.2
    assert lagging.stop() == 0.0 and lagging.samples == pytest.approx([-0.2])
    assert BackgroundSampler(lambda: [10]).stop() is None  # no interval measured
    # the real /proc readers
    monkeypatch.undo()
    assert busy_cpu_seconds() > 0
    assert process_cpu_seconds(os.getpid()) > 0
    assert process_cpu_seconds(2**22 + 12345) is None  # no such process


def test_validation_table_shows_errors_and_unmeasured_mixes(capsys):
    from tandem.planner.plan_validate import print_validation

    row = {"mix": "1P+1D", "quiet_predicted_rps": 2.0, "as_profiled_rps": 1.1, "as_profiled_error": error(1.1, 1.0),
           "background_cores": 3.2, "frontend_ms_per_token": 1.2, "predicted_rps": 1.2, "predicted_bounded": True,
           "measured_rps": 1.0, "measured_bounded": True, "error": error(1.2, 1.0),
           "predicted_text": "1.20", "measured_text": "<1.00",
           "load_avg_before": [5.0, 4.0, 3.0], "load_avg_after": [6.0, 5.0, 4.0]}
    print_validation({"rows": [row, {"mix": "2P+1D", "failed": "did not become ready"}],
                      "recommended_under_load": "1P+1D", "measured_best": "1P+1D", "measured_ranking": ["1P+1D"]})
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("1P+1D"))
    assert "+10%" in line and "+20%" in line and "5.00/6.00" in line and " 1.20 " in line and " <1.00 " in line
    assert "2P+1D not measured: did not become ready" in out
    print_validation({"rows": [{**row, "request_path_ms_per_token": 3.75}], "recommended_under_load": None,
                      "measured_best": None, "measured_ranking": []})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("1P+1D"))
    assert " 1.20    3.75 " in line  # the gateway and client's share, then the whole request path's


def test_engine_counters_sum_every_workers_counters_and_keep_them_per_role():
    """Read from a server's /metrics as the validation does before and after a sweep."""
    import http.server
    import threading

    from tandem.bench.server_cpu import EngineCounters, engine_counters

    text = ('# HELP tandem_engine_step_cpu_seconds_total x\n# TYPE tandem_engine_step_cpu_seconds_total counter\n'
            'tandem_engine_step_cpu_seconds_total{role="prefill",worker="prefill-0"} 1.5\n'
            'tandem_engine_step_cpu_seconds_total{role="decode",worker="decode-0"} 2.25\n'
            'tandem_engine_step_cpu_seconds_created{role="decode",worker="decode-0"} 1.7e9\n'
            '# TYPE tandem_engine_steps_total counter\n'
            'tandem_engine_steps_total{role="prefill",worker="prefill-0"} 40\n'
            'tandem_engine_steps_total{role="decode",worker="decode-0"} 300\n'
            'tandem_engine_steps_created{role="decode",worker="decode-0"} 1.7e9\n'
            '# TYPE tandem_preemptions_total counter\ntandem_preemptions_total{role="decode",worker="decode-0"} 9\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = text.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        before = engine_counters(f"http://127.0.0.1:{server.server_port}")
        assert before == EngineCounters({"prefill": (1.5, 40.0), "decode": (2.25, 300.0)})
        assert (before.step_cpu_s, before.steps) == (3.75, 340.0)
        later = EngineCounters({"prefill": (2.0, 50.0), "decode": (3.0, 350.0), "both": (1.0, 9.0)})
        assert later.since(before) == {"prefill": (0.5, 10.0), "decode": (0.75, 50.0), "both": (1.0, 9.0)}
    finally:
        server.shutdown()
    assert engine_counters("http://127.0.0.1:9") is None  # nothing listening: not a crash


def test_a_gpu_profile_plans_one_gpu_per_worker_without_cpu_sharing(tmp_path, capsys):
    prof = _profile(tmp_path / "profile.json", device="cuda:0")
    code = cli(["plan", "--profile", prof, "--preset", "chat", "--num-prompts", "10", "--rates", "1",
                "--repeats", "1", "--mixes", "1P+1D,colocatedx4", "--no-plots", "--out-dir", str(tmp_path / "out")])
    assert code == 0
    assert "one GPU per worker" in capsys.readouterr().out
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["hardware"]["cores"] is None
    assert plan["recommended"] == "1P+1D"  # the cheaper mix: 2 GPUs


def test_tree_cpu_counts_descendants():
    import subprocess
    import sys

    from tandem.bench.cpu_load import tree_cpu_seconds, wait_until_idle

    # the busy process is a grandchild (a shell runs it): 0.6 s of its own CPU time (however
    # long that takes on this machine), then it says so and sleeps
    spin = "import time\nwhile time.process_time() < 0.6: pass\nprint(1, flush=True)\ntime.sleep(60)"
    proc = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} -c '{spin}'; true"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"1\n"
        assert tree_cpu_seconds(proc.pid) >= 0.5
        # at rest now (both asleep): the wait ends on an idle window, not at its limit
        assert wait_until_idle(proc.pid, max_s=60) < 60
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)], check=False)  # the grandchild first
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_idle_wait_waits_while_the_tree_is_busy_and_gives_up_at_its_limit(monkeypatch):
    from tandem.bench import cpu_load
    from tandem.bench.cpu_load import wait_until_idle

    proc = _FakeProc(monkeypatch)
    proc.cpu, proc.parent = {1: 0.0, 2: 0.0}, {2: 1}
    busy_until = {2: 0.75}  # the child: a core until 0.75 s, then asleep

    def sleep(dt: float) -> None:
        proc.advance(dt, p2=1.0 if proc.now < busy_until[2] else 0.0)
    monkeypatch.setattr(cpu_load.time, "sleep", sleep)
    assert wait_until_idle(1, max_s=10, window_s=0.25) == 1.0  # windows to 0.75 busy, the next idle
    assert wait_until_idle(1, max_s=10, window_s=0.25) == 0.25  # idle at once: one window
    busy_until[2] = 100.0  # never idle: gives up at max_s
    assert wait_until_idle(1, max_s=2.0, window_s=0.25) == 2.0
    # under busy_cores a tree counts as idle (a poll now and then)
    monkeypatch.setattr(cpu_load.time, "sleep", lambda dt: proc.advance(dt, p2=0.04))
    assert wait_until_idle(1, max_s=10, window_s=0.25, busy_cores=0.05) == 0.25


def test_pooled_sweeps_score_each_rate_over_every_sequence():
    """Two sweeps at 1 and 2 req/s: each rate's requests are scored together, so a rate one
    sweep met and the other missed meets the SLO as often as the two together do."""
    from tandem.bench.metrics_math import SLO, summarize
    from tandem.planner.plan_validate import pool

    slo = SLO(ttft_s=0.1, tpot_s=0.05, attainment=0.9)

    def rec(ttft_s: float) -> dict:
        return {"ok": True, "sent": True, "error": None, "ttft_s": ttft_s, "tpot_s": 0.01, "e2e_s": ttft_s + 0.1,
                "itl_s": [0.01] * 10, "output_tokens": 11, "prompt_tokens": 8}

    def sweep(seed: int, fast_at_2: int) -> dict:
        runs = []
        for rate, fast in ((1.0, 10), (2.0, fast_at_2)):
            records = [rec(0.05)] * fast + [rec(0.5)] * (10 - fast)
            runs.append({"rate": rate, "client_cpu_s": 0.5, "requests": records,
                         "summary": summarize(records, 10.0, slo)})
        return {"label": "x", "config": {"requests_per_rate": 10, "seed": seed}, "runs": runs}

    pooled = pool([sweep(0, 10), sweep(1, 7)], slo)  # at 2 req/s: 100% and 70%, 85% together
    assert [r["summary"]["requests"] for r in pooled["runs"]] == [20, 20]
    assert [r["summary"]["attainment"]["both"] for r in pooled["runs"]] == pytest.approx([1.0, 0.85])
    assert pooled["runs"][1]["client_cpu_s"] == 1.0 and pooled["runs"][1]["summary"]["duration_s"] == 20.0
    assert pooled["config"]["requests_per_rate"] == 20 and pooled["config"]["seeds"] == [0, 1]
    assert 1.0 <= pooled["goodput"]["interpolated_rps"] < 2.0
    one = pool([sweep(0, 10)], slo)
    assert one["config"]["seeds"] == [0] and one["runs"][1]["sweeps"] == 1
    with pytest.raises(ValueError, match="rates"):
        pool([sweep(0, 10), {**sweep(1, 10), "runs": sweep(1, 10)["runs"][:1]}], slo)


def test_the_request_paths_cost_per_step_and_per_token_is_fitted_over_the_mixes():
    from tandem.planner.plan_validate import path_fit

    def row(steps: float, tokens: int) -> dict:
        return {"engine_steps": steps, "tokens": tokens, "request_path_cpu_s": 0.005 * steps + 0.0004 * tokens}

    fit = path_fit([row(1000, 20000), row(3000, 15000), {"mix": "2P+1D", "failed": "did not start"}])
    assert (fit["per_step_s"], fit["per_token_s"], fit["mixes"]) == (pytest.approx(0.005), pytest.approx(0.0004), 2)
    assert path_fit([row(1000, 20000), row(2000, 40000)]) is None  # one ratio of steps to tokens: no split
    assert path_fit([{**row(1000, 20000), "engine_steps": None}, row(3000, 15000)]) is None
