"""tandem.protocol: wire messages, header framing, generated code and buf checks."""

from __future__ import annotations

import ast
import filecmp
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.protocol import (
    HEADER_BYTES,
    MAX_HEADER_PAYLOAD,
    CompatibilityDescriptor,
    DecodeRequest,
    IncompatibleKVError,
    KVTransferDescriptor,
    LayerGroupHeader,
    LayerRange,
    PrefillRequest,
    PrefillResult,
    ProtocolError,
    TokenDelta,
    TokenLogprob,
    TransferResult,
    TransferStatus,
    decode_header,
    encode_header,
    layer_groups,
    payload_checksum,
)
from tandem.protocol.gen.tandem.v1 import kv_transfer_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
GEN = ROOT / "services" / "tandem" / "protocol" / "gen"


def _compat(**kw) -> CompatibilityDescriptor:
    base = dict(model_id="tandem-tiny", dtype="float32", num_layers=4, num_kv_heads=2,
                head_dim=64, block_size=16, layout_version=1)
    base.update(kw)
    return CompatibilityDescriptor(**base)


def _descriptor(**kw) -> KVTransferDescriptor:
    base = dict(request_id="req-1", transfer_id="xfer-1", block_ids=(7, 3, 2**40),
                layer_groups=((0, 2), (2, 4)), src_rank=0, dst_rank=1,
                num_prompt_tokens=40, checksum=True)
    base.update(kw)
    return KVTransferDescriptor(**base)


# --------------------------------------------------------------------------- round trips

def test_compatibility_descriptor_round_trip_through_protobuf():
    c = _compat()
    data = c.to_bytes()
    assert CompatibilityDescriptor.from_bytes(data) == c
    raw = pb.CompatibilityDescriptor.FromString(data)  # the bytes are the proto's encoding
    assert (raw.model_id, raw.dtype, raw.num_layers, raw.block_size) == ("tandem-tiny", "float32", 4, 16)


def test_transfer_descriptor_round_trip_and_coercion():
    d = _descriptor(block_ids=[7, 3, 2**40])
    assert d.block_ids == (7, 3, 2**40)
    assert d.layer_groups == (LayerRange(0, 2), LayerRange(2, 4))
    assert d.num_groups == 2
    back = KVTransferDescriptor.from_bytes(d.to_bytes())
    assert back == d
    raw = pb.KVTransferDescriptor.FromString(d.to_bytes())
    assert list(raw.block_ids) == [7, 3, 2**40]
    assert [(g.start, g.stop) for g in raw.layer_groups] == [(0, 2), (2, 4)]
    assert raw.checksum is True and raw.dst_rank == 1 and raw.num_prompt_tokens == 40
    # a 1-rank communicator sends to itself
    assert KVTransferDescriptor.from_bytes(_descriptor(src_rank=0, dst_rank=0).to_bytes()).dst_rank == 0


def test_transfer_descriptor_validation():
    with pytest.raises(ValueError, match="ascending and disjoint"):
        _descriptor(layer_groups=((0, 3), (2, 4)))
    with pytest.raises(ValueError, match="non-empty"):
        _descriptor(layer_groups=((2, 2),))
    with pytest.raises(ValueError, match="must not be empty"):
        _descriptor(layer_groups=())
    with pytest.raises(ValueError, match="block id"):
        _descriptor(block_ids=(1, -1))
    with pytest.raises(ValueError, match="transfer_id"):
        _descriptor(transfer_id="")
    with pytest.raises(FrozenInstanceError):
        _descriptor().transfer_id = "x"  # type: ignore[misc]


def test_layer_groups_helper():
    assert layer_groups(5, 2) == (LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5))
    assert layer_groups(4) == (LayerRange(0, 4),)
    assert layer_groups(4, 10) == (LayerRange(0, 4),)
    assert [list(g.layers) for g in layer_groups(3, 1)] == [[0], [1], [2]]
    start, stop = LayerRange(1, 3)
    assert (start, stop) == (1, 3) and LayerRange(1, 3).num_layers == 2


def test_header_round_trip_keeps_checksum_presence():
    h0 = LayerGroupHeader("xfer-1", 0, 0, checksum=0)
    assert LayerGroupHeader.from_bytes(h0.to_bytes()).checksum == 0  # 0 is a value ...
    h1 = LayerGroupHeader("xfer-1", 3, 1 << 40)
    assert LayerGroupHeader.from_bytes(h1.to_bytes()).checksum is None  # ... absent is None
    h2 = LayerGroupHeader("xfer-1", 1, 123, checksum=2**64 - 1, final=True)
    assert LayerGroupHeader.from_bytes(h2.to_bytes()) == h2
    assert h2.key == ("xfer-1", 1)
    h3 = LayerGroupHeader("xfer-1", 2, 0, aborted=True)
    assert LayerGroupHeader.from_bytes(h3.to_bytes()).aborted
    with pytest.raises(ValueError, match="no payload"):
        LayerGroupHeader("xfer-1", 2, 10, aborted=True)


def test_transfer_result_round_trip():
    ok = TransferResult("xfer-1", TransferStatus.DONE, num_bytes=1 << 33, seconds=0.25)
    back = TransferResult.from_bytes(ok.to_bytes())
    assert back == ok and back.ok and back.error is None and back.bandwidth == (1 << 33) / 0.25
    bad = TransferResult("xfer-2", TransferStatus.FAILED, error="peer died")
    assert TransferResult.from_bytes(bad.to_bytes()) == bad and not bad.ok
    assert TransferResult.from_bytes(TransferResult("x", TransferStatus.ABORTED, error="").to_bytes()).error == ""
    assert pb.TransferResult.FromString(bad.to_bytes()).status == pb.TRANSFER_STATUS_FAILED


def test_unknown_fields_are_ignored_for_forward_compatibility():
    extra = bytes([15 << 3, 1])  # field 15, varint 1: a field a newer peer might add
    assert KVTransferDescriptor.from_bytes(_descriptor().to_bytes() + extra) == _descriptor()
    assert CompatibilityDescriptor.from_bytes(_compat().to_bytes() + extra) == _compat()


def test_bad_bytes_are_protocol_errors():
    with pytest.raises(ProtocolError, match="cannot decode"):
        KVTransferDescriptor.from_bytes(b"\xff\xff\xff")
    with pytest.raises(ProtocolError, match="invalid KVTransferDescriptor"):
        KVTransferDescriptor.from_bytes(b"")  # parses, but has no ids or groups
    with pytest.raises(ProtocolError, match="unknown TransferStatus value 99"):
        TransferResult.from_bytes(pb.TransferResult(transfer_id="x", status=99).SerializeToString())
    assert issubclass(ProtocolError, ValueError)


# --------------------------------------------------------------------------- status enum

def test_transfer_status_mirrors_the_proto_enum_both_ways():
    proto = {v.name: v.number for v in pb.TransferStatus.DESCRIPTOR.values}
    prefix = "TRANSFER_STATUS_"
    assert all(name.startswith(prefix) for name in proto)
    assert {name[len(prefix):]: num for name, num in proto.items()} == \
        {m.name: m.value for m in TransferStatus}
    for m in TransferStatus:
        assert pb.TransferStatus.Value(m.proto_name) == m.value
        assert TransferStatus.from_proto(pb.TransferStatus.Value(prefix + m.name)) is m
    assert TransferStatus.UNSPECIFIED.value == 0
    assert {m for m in TransferStatus if m.is_terminal} == {
        TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.ABORTED}


# --------------------------------------------------------------------------- compatibility

def test_incompatibility_names_each_field_with_both_values():
    ours, theirs = _compat(), _compat(dtype="bfloat16", block_size=32)
    ours.check(_compat())
    assert ours.is_compatible(_compat()) and not ours.is_compatible(theirs)
    with pytest.raises(IncompatibleKVError) as info:
        ours.check(theirs)
    msg = str(info.value)
    assert "dtype: local 'float32' != peer 'bfloat16'" in msg
    assert "block_size: local 16 != peer 32" in msg
    assert "model_id" not in msg and "num_layers" not in msg
    assert info.value.mismatches == {"dtype": ("float32", "bfloat16"), "block_size": (16, 32)}
    assert isinstance(info.value, ValueError)
    again = pickle.loads(pickle.dumps(info.value))  # Ray ships exceptions across actors
    assert str(again) == msg and again.mismatches == info.value.mismatches
    with pytest.raises(IncompatibleKVError, match="layout_version: prefill 1 != decode 2"):
        ours.check(_compat(layout_version=2), ours="prefill", theirs="decode")


def test_compatibility_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        _compat(num_kv_heads=0)
    with pytest.raises(ValueError, match="model_id"):
        _compat(model_id="")
    with pytest.raises(ValueError, match="head_dim"):
        _compat(head_dim=True)


# --------------------------------------------------------------------------- fixed-size header

@pytest.mark.parametrize("header", [
    LayerGroupHeader("x", 0, 0),
    LayerGroupHeader("a" * 64, 2**32 - 1, 2**64 - 1, checksum=2**64 - 1, final=True),
    LayerGroupHeader("0123456789abcdef0123456789abcdef", 3, 4096, checksum=payload_checksum(b"kv")),
    LayerGroupHeader("xfer", 1, 0, aborted=True),
])
def test_header_has_fixed_size_and_round_trips(header):
    buf = encode_header(header)
    assert len(buf) == HEADER_BYTES
    assert decode_header(buf) == header
    assert decode_header(bytearray(buf)) == header
    assert decode_header(memoryview(buf)) == header


def test_header_decodes_from_a_numpy_uint8_buffer():
    np = pytest.importorskip("numpy")
    h = LayerGroupHeader("xfer-9", 5, 77, checksum=1)
    arr = np.frombuffer(encode_header(h), dtype=np.uint8).copy()  # what a uint8 tensor holds
    assert decode_header(arr) == h


def test_oversized_header_is_refused():
    longest = "t" * (MAX_HEADER_PAYLOAD - 40)
    encode_header(LayerGroupHeader(longest, 1, 1))
    with pytest.raises(ValueError, match=f"more than the {MAX_HEADER_PAYLOAD} that fit"):
        encode_header(LayerGroupHeader("t" * 300, 1, 1))


def test_malformed_header_buffers_are_refused():
    buf = encode_header(LayerGroupHeader("xfer", 0, 8))
    with pytest.raises(ProtocolError, match=f"a header is {HEADER_BYTES} bytes"):
        decode_header(buf[:-1])
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(bytes(HEADER_BYTES))  # zeros: a receive buffer that never got a header
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(buf[:4] + (65535).to_bytes(2, "little") + buf[6:])
    with pytest.raises(ProtocolError, match="byte buffer"):
        decode_header(12345)


def test_payload_checksum():
    assert payload_checksum(b"abc") == payload_checksum(memoryview(b"abc")) == 891568578
    assert payload_checksum(b"abc") != payload_checksum(b"abd")


# --------------------------------------------------------------------------- request path

def test_request_path_messages_coerce_validate_and_pickle():
    params = SamplingParams(temperature=0.0, max_tokens=8)
    d = _descriptor()
    pre = PrefillRequest("req-1", [1, 2, 3], params, d)
    assert pre.prompt_token_ids == (1, 2, 3) and pre.num_prompt_tokens == 3
    with pytest.raises(ValueError, match="descriptor is for request 'req-1'"):
        PrefillRequest("req-2", (1,), params, d)
    with pytest.raises(ValueError, match="must not be empty"):
        PrefillRequest("req-1", (), params)
    with pytest.raises(ValueError, match="SamplingParams"):
        PrefillRequest("req-1", (1,), {"temperature": 0})  # type: ignore[arg-type]

    res = PrefillResult("req-1", 42, 3, first_logprob=TokenLogprob(42, -0.5, [(42, -0.5), (7, -1.5)]),
                        num_cached_tokens=2, kv_bytes=1024)
    assert res.first_logprob is not None and res.first_logprob.top == ((42, -0.5), (7, -1.5))
    with pytest.raises(ValueError, match="num_cached_tokens"):
        PrefillResult("req-1", 42, 3, num_cached_tokens=4)

    dec = DecodeRequest("req-1", (1, 2, 3), params, output_token_ids=[42], descriptor=d)
    assert dec.output_token_ids == (42,) and not dec.prefill_locally and dec.num_output_tokens == 1
    assert DecodeRequest("req-1", (1, 2, 3), params).prefill_locally

    for obj in (pre, res, dec, TokenDelta("req-1", (5,), 1)):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_token_logprob_of_duck_types_the_engine_record():
    class EngineLogprob:  # the engine's TokenLogprob has these three attributes
        token_id, logprob, top = 3, -0.25, [(3, -0.25)]

    lp = TokenLogprob.of(EngineLogprob())
    assert lp == TokenLogprob(3, -0.25, ((3, -0.25),))
    delta = TokenDelta("r", (3,), 0, logprobs=[EngineLogprob()])
    assert delta.logprobs == (lp,)


def test_token_delta_rules_and_dedup_on_redrive():
    with pytest.raises(ValueError, match="exactly when finished"):
        TokenDelta("r", (1,), 0, finished=True)
    with pytest.raises(ValueError, match="exactly when finished"):
        TokenDelta("r", (1,), 0, finish_reason=FinishReason.STOP)
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        TokenDelta("r", (1,), 0, logprobs=(TokenLogprob(1, 0.0), TokenLogprob(1, 0.0)))
    assert TokenDelta("r", (1,), 0, True, "length").finish_reason is FinishReason.LENGTH

    # A re-driven decode worker repeats positions 3..4; the caller already has 5 tokens.
    lps = tuple(TokenLogprob(t, -1.0) for t in (13, 14, 15, 16))
    delta = TokenDelta("r", (13, 14, 15, 16), 3, logprobs=lps)
    assert delta.next_index == 7
    fresh = delta.after(5)
    assert fresh == TokenDelta("r", (15, 16), 5, logprobs=lps[2:])
    assert delta.after(3) is delta
    assert delta.after(7) is None  # all duplicates
    end = TokenDelta("r", (13,), 3, True, FinishReason.STOP)
    assert end.after(4) == TokenDelta("r", (), 4, True, FinishReason.STOP)  # keep the finish
    with pytest.raises(ValueError, match="gap in the token stream"):
        delta.after(2)


def test_protocol_imports_no_dev_or_heavy_packages():
    allowed_third_party = {"google"}
    for path in (ROOT / "services" / "tandem" / "protocol").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     and node.module else [])
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in allowed_third_party or \
                    name.startswith(("tandem.common", "tandem.protocol")), f"{path}: {name}"


# --------------------------------------------------------------------------- generated code

def test_generated_code_passes_the_runtime_version_check():
    from google.protobuf import __version__ as runtime

    text = (GEN / "tandem" / "v1" / "kv_transfer_pb2.py").read_text()
    gen = tuple(int(x) for x in re.search(r"Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", text).groups())
    have = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", runtime).groups())
    assert have[0] == gen[0] and have >= gen, (
        f"protobuf {runtime} installed, generated code needs {'.'.join(map(str, gen))} (same major)")
    assert pb.DESCRIPTOR.package == "tandem.v1"
    assert pb.LayerGroupHeader.__module__ == "tandem.protocol.gen.tandem.v1.kv_transfer_pb2"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_committed_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) not installed")
    out = tmp_path / "gen"
    subprocess.run([sys.executable, str(PROTOS / "generate.py"), "--out", str(out)],
                   check=True, cwd=ROOT, timeout=120)
    fresh, committed = _tree(out), _tree(GEN)
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, (f"services/tandem/protocol/gen is stale ({stale}); run protos/check.sh --write "
                       "with the grpcio-tools version pinned in pyproject.toml")
    assert filecmp.dircmp(out, GEN).diff_files == []


# --------------------------------------------------------------------------- buf

def _buf() -> str | None:
    for cand in (shutil.which("buf"), Path(sys.executable).parent / "buf",
                 PROTOS / "node_modules" / ".bin" / "buf", ROOT / "node_modules" / ".bin" / "buf"):
        if cand and Path(cand).is_file():
            return str(cand)
    return None


def _run_buf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    buf = _buf()
    if buf is None:
        pytest.skip("no buf binary on PATH, in the venv or in node_modules/.bin "
                    "(pip install buf-bin, or npm install --prefix protos @bufbuild/buf)")
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_lint_and_breaking_are_clean():
    lint = _run_buf("lint", "protos", cwd=ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = _run_buf("breaking", "protos", "--against", "protos/image.binpb", cwd=ROOT)
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_buf_breaking_catches_a_breaking_change(tmp_path):
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy, ignore=shutil.ignore_patterns("node_modules", "__pycache__"))
    proto = copy / "tandem" / "v1" / "kv_transfer.proto"
    text = proto.read_text()
    assert "uint64 num_bytes = 3;" in text
    proto.write_text(text.replace("uint64 num_bytes = 3;", "uint32 num_bytes = 3;"))
    res = _run_buf("breaking", ".", "--against", "image.binpb", cwd=copy)
    assert res.returncode != 0 and "num_bytes" in res.stdout + res.stderr
