"""A process that holds one engine for its life freezes its start-up heap (engine/gc_freeze.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc, ray
from tandem.engine import gc_freeze
frozen = gc_freeze.freeze()
assert frozen > 1000 and gc.get_freeze_count() == frozen, frozen
a, b = [], []
a.append(b), b.append(a)  # a cycle made after the freeze is still collected
del a, b
assert gc.collect() >= 2
assert not gc_freeze.in_actor_process() and not ray.is_initialized()  # asking does not start Ray
print("ok")
"""


def test_freeze_leaves_new_cycles_to_the_collector_and_asks_without_starting_ray():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert "leaked" not in proc.stderr  # unfrozen at exit: the shutdown's collections see it all
