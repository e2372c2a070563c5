"""Benchmarks name the CPU their figures come from: model, family and model number, and the
vector instruction set the native kernels use there."""

from tandem.bench import runinfo
from tandem.engine.kernels.cpu_features import vector_isa

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma

processor\t: 1
cpu family\t: 99
model name\t: something else
flags\t\t: avx512f amx_bf16
"""


def test_the_widest_vector_instruction_set_is_named():
    assert vector_isa(frozenset({"avx2", "fma"})) == "AVX2"
    assert vector_isa(frozenset({"avx2", "avx512f"})) == "AVX-512"
    assert vector_isa(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "AVX-512 BF16"
    assert vector_isa(frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})) == "AMX"
    assert vector_isa(frozenset({"sse4_2"})) == "no AVX2"


def test_a_generic_cpu_name_gains_its_family_model_and_instruction_set():
    assert runinfo.cpu_description(EPYC) == "AMD EPYC (family 25 model 1, AVX2)"
    no_family = "model name\t: Some CPU\nflags\t: sse4_2\n"
    assert runinfo.cpu_description(no_family) == "Some CPU (no AVX2)"
    assert runinfo.cpu_description("processor\t: 0\n") is None


def test_the_machine_line_names_this_cpu():
    line = runinfo.machine_line()
    assert line.startswith("machine: ") and "usable cores" in line and "load average" in line
    cpu = runinfo.machine()["cpu"]
    assert cpu is None or cpu in line


def test_the_machine_line_says_which_cpu_flags_a_run_hid(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_FLAGS_OFF", "amx_tile, amx_bf16")
    assert runinfo.machine_line().endswith(", run as without CPU flags amx_bf16,amx_tile (TANDEM_CPU_FLAGS_OFF)")
    for nothing in (",", " "):
        monkeypatch.setenv("TANDEM_CPU_FLAGS_OFF", nothing)
        assert "TANDEM_CPU_FLAGS_OFF" not in runinfo.machine_line()
