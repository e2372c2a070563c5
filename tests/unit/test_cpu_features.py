"""The CPU features the engine picks its paths by, and the switch that hides some of them."""

from __future__ import annotations

import pytest

from tandem.engine.kernels import cpu_features


@pytest.fixture
def fresh_flags():
    cpu_features.cpu_flags.cache_clear()
    yield
    cpu_features.cpu_flags.cache_clear()


def test_flags_named_off_are_not_seen(monkeypatch, fresh_flags):
    every = cpu_features.cpu_flags()
    if not {"sse2", "fpu"} <= every:
        pytest.skip("no x86 /proc/cpuinfo here")
    cpu_features.cpu_flags.cache_clear()
    monkeypatch.setenv("TANDEM_CPU_FLAGS_OFF", " sse2, fpu ,,not_a_flag")
    hidden = cpu_features.cpu_flags()
    assert hidden == every - {"sse2", "fpu"}
    assert cpu_features.proc_flags() == every  # what the native kernels are compiled for


def test_without_amx_flags_no_amx_path_is_taken(monkeypatch, fresh_flags):
    monkeypatch.setenv("TANDEM_CPU_FLAGS_OFF", "amx_bf16,avx512_bf16")
    assert not cpu_features.has_amx_bf16() and not cpu_features.has_native_bf16()
    assert cpu_features.vector_isa() in ("AVX-512", "AVX2", "no AVX2")

