#!/usr/bin/env bash
# Guard the wire schemas in protos/ (services/ARCHITECTURE.md, "KV protocol"):
#   1. the generated Python code in services/tandem/protocol/gen/ matches what grpcio-tools
#      makes from the .proto files now (regenerated into a temp dir and diffed);
#   2. `buf lint` (STANDARD rules) is clean;
#   3. `buf breaking` finds no breaking change against the committed image protos/image.binpb.
# Steps 2-3 run when a buf binary is found (PATH, the venv's bin, protos/node_modules/.bin);
# otherwise they are skipped with a note, or fail when REQUIRE_BUF=1.
#
#   protos/check.sh            check (exit non-zero on any failure)
#   protos/check.sh --write    regenerate services/tandem/protocol/gen/ in place, then check
#   protos/check.sh --update-image
#                              after an accepted (non-breaking) change: rebuild image.binpb
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3), BUF, REQUIRE_BUF.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

find_buf() {
  if [[ -n "${BUF:-}" ]]; then echo "$BUF"; return; fi
  local c
  for c in "$(command -v buf || true)" "$(dirname "$PYTHON")/buf" "$HERE/node_modules/.bin/buf"; do
    if [[ -n "$c" && -x "$c" ]]; then echo "$c"; return; fi
  done
}

mode="${1:-check}"
case "$mode" in
  check|--write|--update-image) ;;
  *) echo "usage: $0 [--write|--update-image]" >&2; exit 2 ;;
esac

BUF_BIN="$(find_buf || true)"
if [[ "$mode" == "--update-image" ]]; then
  [[ -n "$BUF_BIN" ]] || { echo "check.sh: no buf binary found (pip install buf-bin)" >&2; exit 1; }
  "$BUF_BIN" build protos --exclude-source-info -o protos/image.binpb
  echo "check.sh: wrote protos/image.binpb"
  exit 0
fi
if [[ "$mode" == "--write" ]]; then
  "$PYTHON" protos/generate.py
fi

status=0
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# 1. generated code is current
"$PYTHON" protos/generate.py --out "$tmp/gen"
if diff -r -x __pycache__ "$tmp/gen" services/tandem/protocol/gen >"$tmp/diff"; then
  echo "check.sh: services/tandem/protocol/gen is up to date"
else
  cat "$tmp/diff" | head -40
  echo "check.sh: services/tandem/protocol/gen is stale: run protos/check.sh --write" \
       "(grpcio-tools $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))'))" >&2
  status=1
fi

# 2-3. buf lint and buf breaking
if [[ -z "$BUF_BIN" ]]; then
  msg="check.sh: no buf binary (pip install buf-bin, or npm install --prefix protos @bufbuild/buf)"
  if [[ "${REQUIRE_BUF:-0}" == "1" ]]; then echo "$msg: failing (REQUIRE_BUF=1)" >&2; exit 1; fi
  echo "$msg: buf lint and buf breaking skipped" >&2
else
  if "$BUF_BIN" lint protos; then echo "check.sh: buf lint clean ($("$BUF_BIN" --version))"
  else echo "check.sh: buf lint failed" >&2; status=1; fi
  if "$BUF_BIN" breaking protos --against protos/image.binpb; then
    echo "check.sh: buf breaking: no breaking change against protos/image.binpb"
  else echo "check.sh: buf breaking failed against protos/image.binpb" >&2; status=1; fi
  # Not an error: an additive change that has not been recorded in the image yet.
  "$BUF_BIN" build protos --exclude-source-info -o "$tmp/image.binpb"
  if ! cmp -s "$tmp/image.binpb" protos/image.binpb; then
    echo "check.sh: note: protos/ differs from image.binpb (compatible); once merged," \
         "record it with protos/check.sh --update-image" >&2
  fi
fi
exit $status
