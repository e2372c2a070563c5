"""Assertions and request bodies shared by the gateway error tests."""

from __future__ import annotations

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
