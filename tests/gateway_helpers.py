"""Assertions and request bodies shared by the gateway error tests."""

from __future__ import annotations

import re

import httpx

MODEL = "fake-model"


def assert_error(r: httpx.Response, status: int, param: str | None = "*", code: str | None = "*") -> dict:
    """An OpenAI-shaped error with this status (and param/code, unless ``"*"``)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "*":
        assert err["param"] == param, err
    if code != "*":
        assert err["code"] == code, err
    return err


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


# What must never reach a client: tracebacks, source paths, pids, IPs, Ray ids and names.
_INTERNALS = [re.compile(p, re.I) for p in (
    r"traceback", r'file "', r"\.py\b", r"\bpid\b", r"\b\d{1,3}(\.\d{1,3}){3}\b", r"(/[\w.-]+){2,}",
    r"site-packages", r"\bray\b", r"\bactor", r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b", r"\bworker[-_ ]?(id|\d)", r"exception",
    r"0x[0-9a-f]{4,}", r"\x1b\[")]


def assert_no_internals(body: str) -> None:
    """``body`` (a response body) names nothing of the server's insides."""
    for pattern in _INTERNALS:
        assert not pattern.search(body), f"{pattern.pattern!r} found in {body[:500]!r}"
