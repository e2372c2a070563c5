#!/usr/bin/env bash
# Links every Grafana dashboard of deploy/grafana/ (any depth) into the chart's
# dashboards/ folder as a relative symlink, and removes links whose target is
# gone. Helm follows the links when it loads or packages the chart, so the
# chart always ships the dashboards exactly as deploy/grafana/ has them.
# tests/integration/test_helm.py fails while a link is missing or dangling.
set -euo pipefail
cd "$(dirname "$0")/tandem/dashboards"
src=../../../deploy/grafana
# Drop dangling links first (a removed or renamed dashboard).
find . -maxdepth 1 -type l ! -exec test -e {} \; -print -delete
[ -d "$src" ] || exit 0
find "$src" -type f -name '*.json' | sort | while read -r f; do
  name=$(basename "$f")
  if [ -e "$name" ] && [ "$(readlink "$name")" != "$f" ]; then
    echo "two dashboards are named $name: rename one under deploy/grafana/" >&2
    exit 1
  fi
  ln -sfn "$f" "$name"
  echo "linked dashboards/$name -> $f"
done
