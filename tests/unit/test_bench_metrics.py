"""Serving-benchmark math on recorded synthetic traces with known answers: TTFT, ITL, TPOT,
percentiles, SLO attainment, goodput search over rates; arrival processes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.bench.arrivals import arrival_offsets, parse_rates
from tandem.bench.client import StreamResult
from tandem.bench.loadgen import make_record
from tandem.bench.metrics_math import SLO, attainment, goodput, goodput_text, latencies, meets, percentile, summarize
from tandem.bench.workload import BenchRequest

# ---------------------------------------------------------------- per request


def test_latencies_of_a_recorded_trace():
    # sent at 10.0; chunks at +0.1, +0.15, +0.25, +0.30; stream closed at +0.32; 4 tokens
    lat = latencies(10.0, [10.1, 10.15, 10.25, 10.30], 10.32, 4)
    assert lat["ttft_s"] == pytest.approx(0.1)
    assert lat["itl_s"] == pytest.approx([0.05, 0.10, 0.05])
    assert lat["e2e_s"] == pytest.approx(0.32)
    assert lat["tpot_s"] == pytest.approx((0.32 - 0.1) / 3)


def test_tpot_uses_the_reported_token_count_not_the_chunk_count():
    # 2 chunks carried 5 tokens (a server may coalesce): TPOT divides by tokens - 1
    lat = latencies(0.0, [0.2, 1.0], 1.0, 5)
    assert lat["tpot_s"] == pytest.approx(0.8 / 4)
    assert lat["itl_s"] == pytest.approx([0.8])


def test_one_token_has_no_tpot_and_no_tokens_has_no_ttft():
    assert latencies(0.0, [0.5], 0.5, 1)["tpot_s"] is None
    lat = latencies(0.0, [], 0.7, 0)
    assert lat["ttft_s"] is None and lat["tpot_s"] is None and lat["itl_s"] == []
    assert lat["e2e_s"] == pytest.approx(0.7)


def _req(i=0, out=4, kind="k"):
    return BenchRequest(i, [5] * 8, 8, out, kind)


def test_make_record_from_a_stream_result():
    res = StreamResult(send_t=100.0, token_times=[100.2, 100.3, 100.5], chunk_tokens=[1, 2, 1], done_t=100.5,
                       status=200, prompt_tokens=8, completion_tokens=4)
    rec = make_record(_req(out=4), 0.25, res, t0=99.5)
    assert rec["ok"] and rec["error"] is None
    assert rec["sent_s"] == pytest.approx(0.5) and rec["scheduled_s"] == 0.25
    assert rec["output_tokens"] == 4 and rec["chunks"] == 3 and rec["multi_token_chunks"] == 1
    assert rec["ttft_s"] == pytest.approx(0.2) and rec["tpot_s"] == pytest.approx(0.3 / 3)
    failed = make_record(_req(), 0.0, StreamResult(send_t=1.0, done_t=1.1, status=429, error="http_429"), 0.0)
    assert not failed["ok"] and failed["error"] == "http_429"
    empty = make_record(_req(), 0.0, StreamResult(send_t=1.0, done_t=1.1, status=200, completion_tokens=4), 0.0)
    assert not empty["ok"] and empty["error"] == "no_tokens"  # never silently "ok" without timings


# ---------------------------------------------------------------- percentiles


def test_percentiles_match_numpy_linear_interpolation():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile(range(1, 11), 50) == pytest.approx(5.5)
    assert percentile(range(1, 11), 90) == pytest.approx(9.1)
    assert percentile(range(1, 11), 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


# ---------------------------------------------------------------- SLO


def _rec(ttft, tpot, ok=True, kind="k", itl=(), out=10):
    return {"ok": ok, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": None if ttft is None else ttft + 1.0,
            "itl_s": list(itl), "output_tokens": out if ok else 0, "prompt_tokens": 8 if ok else None,
            "error": None if ok else "timeout", "kind": kind, "expected_output_tokens": out}


def test_meets_both_targets_and_failures_miss():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    assert meets(_rec(0.5, 0.05), slo)  # on the line meets
    assert not meets(_rec(0.51, 0.01), slo)
    assert not meets(_rec(0.1, 0.051), slo)
    assert meets(_rec(0.1, None), slo)  # one-token outputs have no TPOT
    assert not meets(_rec(None, None, ok=False), slo)
    assert meets(_rec(9.0, 9.0), SLO())  # no targets
    assert meets(_rec(0.6, 0.01), slo, "tpot") and not meets(_rec(0.6, 0.01), slo, "ttft")


def test_attainment_counts_failures_in_the_denominator():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [_rec(0.2, 0.05), _rec(0.3, 0.2), _rec(2.0, 0.05), _rec(0.1, 0.01), _rec(None, None, ok=False)]
    assert attainment(records, slo) == pytest.approx({"both": 2 / 5, "ttft": 3 / 5, "tpot": 3 / 5})
    assert attainment([], slo) == {"both": None, "ttft": None, "tpot": None}


def test_slo_validates():
    with pytest.raises(ValueError):
        SLO(attainment=0.0)
    with pytest.raises(ValueError):
        SLO(ttft_s=-1.0)
    assert SLO(0.5, 0.05, 0.9).to_json() == {"ttft_ms": 500.0, "tpot_ms": 50.0, "attainment": 0.9}


def test_summary_of_a_recorded_run():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [_rec(0.1, 0.02, itl=[0.02, 0.03], kind="a"), _rec(0.3, 0.04, itl=[0.05], kind="a"),
               _rec(2.0, 0.05, itl=[0.01], kind="b"), _rec(None, None, ok=False, kind="b"),
               {**_rec(None, None, ok=False), "error": "http_429"}]
    s = summarize(records, duration_s=10.0, slo=slo)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["errors"] == {"http_429": 1, "timeout": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(800.0)
    assert s["itl_ms"]["count"] == 4 and s["itl_ms"]["p50"] == pytest.approx(25.0)
    assert s["tpot_ms"]["p90"] == pytest.approx(float(np.percentile([20, 40, 50], 90)))
    assert s["throughput"]["requests_per_s"] == pytest.approx(0.3)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["throughput"]["good_requests_per_s"] == pytest.approx(0.2)
    assert s["attainment"]["both"] == pytest.approx(2 / 5)
    assert s["by_kind"]["a"]["attainment"]["both"] == 1.0 and s["by_kind"]["b"]["completed"] == 1
    assert s["output_len_mismatches"] == 0


# ---------------------------------------------------------------- goodput


def test_goodput_is_the_highest_rate_meeting_the_target():
    g = goodput([(1, 1.0), (2, 0.95), (3, 0.8), (4, 0.5)], 0.9)
    assert g["rps"] == 2 and g["bounded"]
    assert g["interpolated_rps"] == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.8))


def test_goodput_search_is_order_free_and_conservative_on_noisy_curves():
    g = goodput([(3, 0.95), (1, 0.95), (2, 0.85)], 0.9)  # a dip at 2: 3 does not count
    assert g["rps"] == 1 and g["interpolated_rps"] == pytest.approx(1.5)
    assert g["points"] == [[1, 0.95], [2, 0.85], [3, 0.95]]


def test_goodput_edges():
    none = goodput([(1, 0.5), (2, 0.2)], 0.9)
    assert none["rps"] == 0.0 and none["interpolated_rps"] == 0.0 and none["bounded"]
    every = goodput([(1, 1.0), (2, 0.9)], 0.9)  # exactly the target passes
    assert every["rps"] == 2 and not every["bounded"]  # a lower bound: sweep higher
    assert goodput([(1, 1.0), (math.inf, 0.1)], 0.9)["rps"] == 1  # bursts are not rates
    assert goodput([], 0.9)["rps"] == 0.0
    flat = goodput([(1, 0.95), (2, 0.5)], 0.99)
    assert flat["rps"] == 0.0


def test_goodput_says_which_side_of_the_sweep_it_fell():
    below = goodput([(0.5, 0.8), (1, 0.1)], 0.9)  # the lowest rate missed: under 0.5, not 0
    assert below["below_sweep"] and goodput_text(below) == "<0.50"
    above = goodput([(1, 1.0), (2, 0.95)], 0.9)  # every rate passed: at least 2
    assert not above["below_sweep"] and goodput_text(above) == "2.00+"
    inside = goodput([(1, 1.0), (2, 0.8)], 0.9)
    assert not inside["below_sweep"] and goodput_text(inside) == "1.50"
    assert not goodput([], 0.9)["below_sweep"]


def test_bench_serve_says_its_goodput_is_below_the_sweep(capsys):
    from tandem.bench.serve import print_summary

    result = {"label": "vllm", "slo": {"ttft_ms": 2500.0, "tpot_ms": 60.0, "attainment": 0.9},
              "config": {"workload_name": "interference", "arrival": "poisson", "requests_per_rate": 40},
              "runs": [], "goodput": goodput([(0.5, 0.05), (1, 0.0)], 0.9)}
    print_summary(result)
    assert "goodput: below 0.5 req/s (the lowest rate swept missed the SLO" in capsys.readouterr().out


def test_goodput_of_recorded_sweeps():
    # three rates, 10 requests each: 10/10, 9/10, 6/10 meet a 200 ms TTFT target
    slo = SLO(ttft_s=0.2)
    sweep = {1.0: [0.1] * 10, 2.0: [0.1] * 9 + [0.5], 4.0: [0.1] * 6 + [0.5] * 4}
    points = [(rate, attainment([_rec(t, 0.01) for t in ttfts], slo)["both"]) for rate, ttfts in sweep.items()]
    g = goodput(points, 0.9)
    assert g["rps"] == 2.0 and g["interpolated_rps"] == pytest.approx(2.0)


# ---------------------------------------------------------------- arrivals


def test_poisson_is_reproducible_from_its_seed():
    a = arrival_offsets("poisson", 4.0, 50, seed=7)
    assert a == arrival_offsets("poisson", 4.0, 50, seed=7)
    assert a != arrival_offsets("poisson", 4.0, 50, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    # the same unit gaps at every rate: the sweep's points differ by the rate only
    assert arrival_offsets("poisson", 2.0, 50, seed=7) == pytest.approx([2 * x for x in a])


def test_poisson_gaps_have_the_rate():
    a = np.array(arrival_offsets("poisson", 5.0, 20001, seed=1))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: std == mean


def test_constant_and_burst():
    assert arrival_offsets("constant", 4.0, 5) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert arrival_offsets("burst", 2.0, 7, burst_size=3) == pytest.approx([0, 0, 0, 1.5, 1.5, 1.5, 3.0])
    assert arrival_offsets("burst", 2.0, 4) == [0.0] * 4  # one burst of everything
    assert arrival_offsets("poisson", math.inf, 3) == [0.0] * 3
    assert arrival_offsets("constant", 1.0, 0) == []


def test_arrival_and_rate_errors():
    with pytest.raises(ValueError):
        arrival_offsets("gamma", 1.0, 3)
    with pytest.raises(ValueError):
        arrival_offsets("poisson", 0.0, 3)
    assert parse_rates("1, 2,4") == [1.0, 2.0, 4.0]
    assert parse_rates("inf") == [math.inf]
    for bad in ("", "a,b", "1,-2", "0"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_requests_cut_before_sending_are_not_sent_not_errors():
    """A request whose arrival lies past the run's --max-duration never reaches the server:
    recorded ``sent: false`` with no error, counted as ``not_sent``, out of every figure."""
    import asyncio
    import json as _json

    import httpx

    from tandem.bench.loadgen import run_requests

    def handler(request: httpx.Request) -> httpx.Response:
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
        body = "".join(f"data: {x}\n\n" for x in (_json.dumps(
            {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}), _json.dumps(usage), "[DONE]"))
        return httpx.Response(200, content=body.encode())

    reqs = [BenchRequest(i, [1] * 4, 4, 1, "k") for i in range(3)]
    res = asyncio.run(run_requests("http://x", "m", reqs, [0.0, 0.0, 30.0], max_duration_s=0.5,
                                   request_timeout_s=10, progress=False,
                                   transport=httpx.MockTransport(handler)))
    cut = res.records[2]
    assert cut["sent"] is False and cut["error"] is None and not cut["ok"]
    assert all(r["sent"] for r in res.records[:2])
    s = summarize(res.records, res.duration_s, SLO(ttft_s=10.0, tpot_s=10.0, attainment=0.9))
    assert s["not_sent"] == 1 and s["requests"] == 2 and s["completed"] == 2
    assert s["failed"] == 0 and s["errors"] == {} and s["attainment"]["both"] == 1.0
