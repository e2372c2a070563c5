"""``tandem bench migrate`` on the tiny test checkpoint (real Ray actors, gloo): both parts
run, the table and the JSON hold every context and arm, the moves and re-drives happen,
and every stream's tokens equal the other arm's. Timings are this machine's: not checked."""

from __future__ import annotations

import argparse
import json

from tandem.bench import migrate
from tandem.bench.migrate_pause import longest_context


def test_bench_migrate_pauses_and_a_drain_under_load(ray_session, checkpoint, tmp_path, capsys):
    out = tmp_path / "migrate.json"
    parser = argparse.ArgumentParser()
    migrate.add_arguments(parser)
    args = parser.parse_args([
        "--model", checkpoint, "--contexts", "32,128", "--repeats", "2", "--move-after", "4",
        "--output-len", "96", "--streams", "4", "--load-prompt-len", "40",
        "--load-output-len", "96", "--drain-after", "8", "--drain-repeats", "1",
        "--json", str(out)])
    assert migrate.main(args) == 0  # 1: some stream's tokens differ between the arms
    data = json.loads(out.read_text())
    assert data["schema"] == migrate.SCHEMA and data["mismatches"] == 0
    assert data["run"]["machine"]["cpu_count"] >= 1
    # the checkpoint's 512 positions bound the longest context, not its large KV cache
    assert data["longest_context"] == longest_context(512, data["cache_tokens"], 96, 4, 16) == 419

    rows = data["pause"]
    assert [r["context"] for r in rows] == [32, 128]
    for r in rows:
        assert r["repeats"] == 2 and r["mismatches"] == []
        mig, red = r["migrate"], r["redrive"]
        assert len(mig["pause_ms"]) == len(red["pause_ms"]) == 2
        assert red["outcomes"] == ["redriven"] * 2 and red["redriven"] == 2
        assert all(o == "migrated" or o.startswith(("failed", "not asked")) for o in mig["outcomes"])
        assert all((p is not None) == (o == "migrated")
                   for p, o in zip(mig["pause_ms"], mig["outcomes"]))
    assert sum(r["migrate"]["moved"] for r in rows) >= 1  # some move completed mid-stream
    assert rows[-1]["migrate"]["kv_mb"] > 0

    drain = data["drain"]
    assert drain["mismatches"] == []
    (moved,), (redriven,) = drain["runs"]["migrate"], drain["runs"]["redrive"]
    for run in (moved, redriven):
        assert run["tokens"] == 4 * 96 and run["errors"] == [], run  # every stream complete
        assert run["streams_on_it"] >= 1 and run["drained"].startswith("decode-")
    assert moved["migrated"] >= 1
    assert redriven["migrated"] == 0 and redriven["redriven"] >= 1
    assert set(drain["median"]) == {"migrate", "redrive"} and drain["goodput_ratio"] > 0

    text = capsys.readouterr().out
    assert "pause of a stream moving" in text and "goodput migrate/re-drive" in text
    assert text.count("\n     32 ") == 1 and text.count("\n    128 ") == 1
