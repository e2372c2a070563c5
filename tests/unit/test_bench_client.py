"""The benchmark client and load generator against in-process fake servers (httpx mock
transports): SSE parsing, errors counted by kind, the run deadline, the ratio table."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.bench.client import completion_body, sse_data, stream_completion
from tandem.bench.compare import print_table, ratios
from tandem.bench.metrics_math import goodput
from tandem.bench.loadgen import run_requests
from tandem.bench.workload import BenchRequest


def _sse(events: list[dict | str]) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chunk(text: str = "", tokens: int | None = 1) -> dict:
    lps = None if tokens is None else {"tokens": [""] * tokens, "token_logprobs": [0.0] * tokens}
    return {"choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}}


def _run(handler, body=None, timeout_s=5.0):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_completion(client, "http://x", body or completion_body("m", [1, 2], 4, logprobs=0),
                                           timeout_s)
    return asyncio.run(go())


def test_a_stream_is_timed_per_token_chunk_even_without_text():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse([_chunk(""), _chunk("a", 2), _chunk(""), USAGE, "[DONE]"]))

    res = _run(handler)
    assert res.error is None and res.status == 200
    assert len(res.token_times) == 3 and res.chunk_tokens == [1, 2, 1]
    assert (res.prompt_tokens, res.completion_tokens) == (8, 4)
    assert seen["ignore_eos"] is True and seen["logprobs"] == 0 and seen["stream_options"]["include_usage"]
    assert seen["prompt"] == [1, 2] and seen["max_tokens"] == 4


def test_text_timing_counts_only_chunks_with_text():
    content = _sse([_chunk("", None), _chunk("hi", None), {"choices": [{"text": "", "finish_reason": "length"}]},
                    "[DONE]"])
    res = _run(lambda r: httpx.Response(200, content=content), completion_body("m", "p", 4))
    assert res.error is None and len(res.token_times) == 1 and res.chunk_tokens == [None]


@pytest.mark.parametrize("handler, kind", [
    (lambda r: httpx.Response(429, json={"error": {"message": "full"}}), "http_429"),
    (lambda r: httpx.Response(503, text="down"), "http_503"),
    (lambda r: httpx.Response(200, content=_sse([_chunk("a"), {"error": {"message": "boom"}}])), "stream_error"),
    (lambda r: httpx.Response(200, content=_sse([_chunk("a")])), "incomplete"),
    (lambda r: httpx.Response(200, content=b"data: {not json\n\n"), "protocol"),
])
def test_errors_are_recorded_by_kind(handler, kind):
    res = _run(handler)
    assert res.error == kind and res.detail


def _events(raw: bytes, piece: int) -> list[str]:
    async def chunks():
        for i in range(0, len(raw), piece):
            yield raw[i:i + piece]

    async def go():
        return [e async for e in sse_data(chunks())]
    return asyncio.run(go())


@pytest.mark.parametrize("piece", [1, 2, 7, 1 << 20])  # any chunking, CRLF and UTF-8 split across chunks
def test_sse_lines_end_only_at_the_specs_line_endings(piece):
    raw = ('data: {"t":"a\u2028b\u2029c\x85d\x1ce"}\r\n\r\n: a comment\n'
           'event: x\ndata: one\rdata:two\r\r'
           'data: 日本\n\ndata: cut off').encode()
    assert _events(raw, piece) == ['{"t":"a\u2028b\u2029c\x85d\x1ce"}', "one\ntwo", "日本"]


def test_a_raw_line_separator_inside_an_event_does_not_cut_it():
    text = "before\u2028after\x85end"
    content = _sse([_chunk(text), USAGE, "[DONE]"])  # json.dumps escapes them; send them raw instead
    content = content.replace(b"\\u2028", "\u2028".encode()).replace(b"\\u0085", "\x85".encode())
    assert "\u2028".encode() in content
    res = _run(lambda r: httpx.Response(200, content=content))
    assert res.error is None and res.done_t is not None and res.completion_tokens == 4


def test_transport_failures_are_timeout_or_connection():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    def stall(request):
        raise httpx.ReadTimeout("slow", request=request)

    assert _run(refuse).error == "connection"
    assert _run(stall).error == "timeout"


def test_the_whole_request_has_a_deadline():
    class Slow(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield _sse([_chunk("a")])
            await asyncio.sleep(5)

    res = _run(lambda r: httpx.Response(200, stream=Slow()), timeout_s=0.2)
    assert res.error == "timeout" and len(res.token_times) == 1


def test_run_requests_records_every_request_including_failures_and_the_deadline():
    class Slow(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield _sse([_chunk("a")])
            await asyncio.sleep(10)

    def handler(request: httpx.Request) -> httpx.Response:
        n = json.loads(request.content)["max_tokens"]
        if n == 2:
            return httpx.Response(429, json={"error": {"message": "busy"}})
        if n == 3:
            return httpx.Response(200, stream=Slow())
        return httpx.Response(200, content=_sse([_chunk("a"), _chunk("b"), USAGE, "[DONE]"]))

    reqs = [BenchRequest(i, [1] * 4, 4, out, "k") for i, out in enumerate([4, 2, 4, 3])]
    res = asyncio.run(run_requests("http://x", "m", reqs, [0.0, 0.0, 0.05, 0.0], max_duration_s=0.5,
                                   request_timeout_s=30, progress=False, transport=httpx.MockTransport(handler)))
    by_index = {r["index"]: r for r in res.records}
    assert len(res.records) == 4 and [r["index"] for r in res.records] == [0, 1, 2, 3]
    assert by_index[0]["ok"] and by_index[0]["output_tokens"] == 4 and by_index[0]["ttft_s"] is not None
    assert by_index[2]["ok"] and by_index[2]["sent_s"] >= 0.05
    assert by_index[1]["error"] == "http_429"
    assert by_index[3]["error"] == "deadline"  # still in flight when the run ended
    # one request unfinished: the run lasted until its 0.5 s deadline, past every completion
    assert res.duration_s > 0.4
    assert res.duration_s >= max(r["sent_s"] + r["e2e_s"] for r in res.records if r["e2e_s"] is not None)


def _result(label, good, ttft, tpot, att):
    runs = [{"rate": 1.0, "summary": {"ttft_ms": {"p90": ttft}, "tpot_ms": {"p90": tpot},
                                      "attainment": {"both": att}}}]
    return {"label": label, "runs": runs,
            "goodput": {"interpolated_rps": good, "bounded": True, "below_sweep": False, "points": [[1.0, att]]}}


def test_ratio_table_divides_by_the_baseline():
    table = ratios([_result("disaggregated", 3.0, 200.0, 40.0, 0.95),
                    _result("colocated", 2.0, 100.0, 50.0, 0.8)], "colocated")
    rows = {r["metric"]: r for r in table["rows"]}
    assert table["baseline"] == "colocated"
    assert rows["goodput (req/s)"]["ratio_to_baseline"]["disaggregated"] == pytest.approx(1.5)
    assert rows["p90 TTFT (ms) @ 1/s"]["ratio_to_baseline"]["disaggregated"] == pytest.approx(2.0)
    assert rows["p90 TPOT (ms) @ 1/s"]["ratio_to_baseline"]["disaggregated"] == pytest.approx(0.8)
    zero = ratios([_result("a", 1.0, 1.0, 1.0, 1.0), _result("colocated", 0.0, 1.0, 1.0, 1.0)], "colocated")
    assert zero["rows"][0]["ratio_to_baseline"]["a"] is None  # no division by a zero goodput


def test_ratio_table_marks_a_goodput_outside_the_sweep(capsys):
    # vLLM missed the SLO at the lowest rate (its goodput is under 0.5, not 0); colocated
    # met it at every rate (at least 2)
    low = {**_result("vllm", 0.0, 1.0, 1.0, 0.0), "goodput": goodput([(0.5, 0.05), (2, 0.0)], 0.9)}
    high = {**_result("colocated", 2.0, 1.0, 1.0, 1.0), "goodput": goodput([(0.5, 1.0), (2, 0.95)], 0.9)}
    print_table(ratios([low, high], "colocated"), ["vllm", "colocated"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("goodput"))
    assert line.split()[2:4] == ["<0.50", "2.00+"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("status, body", [(404, b"not here"), (200, b"<html>hello</html>"),
                                          (200, b'{"data": []}')])
def test_bench_serve_says_what_is_wrong_with_the_server_it_was_given(capsys, status, body):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tandem.cli.main import main

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    argv = ["bench", "serve", "--num-prompts", "2", "--rates", "1", "--no-plots"]
    assert main([*argv, "--url", f"http://127.0.0.1:{_closed_port()}"]) == 2
    assert "cannot reach http://127.0.0.1:" in capsys.readouterr().err
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert main([*argv, "--url", f"http://127.0.0.1:{server.server_port}"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and "Traceback" not in err
    assert (f"HTTP {status}" if status != 200 else "lists no model") in err


def test_bench_compare_checks_the_other_server_before_starting_its_own(capsys, tmp_path, monkeypatch):
    from tandem.bench import compare
    from tandem.cli.main import main

    def must_not_start(*args, **kwargs):
        raise AssertionError("a tandem server was started before --other-url was checked")

    monkeypatch.setattr(compare, "_servers", must_not_start)
    argv = ["bench", "compare", "--num-prompts", "2", "--rates", "1", "--no-plots",
            "--out-dir", str(tmp_path), "--other-model-name", "bench"]
    assert main([*argv, "--other-url", f"http://127.0.0.1:{_closed_port()}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and "Traceback" not in err
