"""The device check's results and its one summary table."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Status(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"  # wrong, or crashed
    MISS = "MISS"  # ran and is correct, but below its performance target
    SKIP = "SKIP"  # could not run here (says why)
    INFO = "INFO"  # a figure with no target
    DRY = "DRY"  # dry run: figure of the plumbing on CPU, target not judged


@dataclass(frozen=True)
class Result:
    section: str
    status: Status
    result: str  # what was found, one line
    figure: str = ""  # the measured number with its unit
    target: str = ""  # what it should be


# exit codes
OK, FAILED, NO_DEVICE, NOTHING_PASSED = 0, 1, 2, 3


def exit_code(results: Iterable[Result]) -> int:
    """FAILED on any FAIL or MISS; NOTHING_PASSED when nothing passed (all skipped)."""
    results = list(results)
    if any(r.status in (Status.FAIL, Status.MISS) for r in results):
        return FAILED
    if not any(r.status == Status.PASS for r in results):
        return NOTHING_PASSED
    return OK


def table(results: Iterable[Result], header: str = "") -> str:
    """A fixed-width text table: section | status | result | figure | target."""
    rows = [("section", "status", "result", "figure", "target")]
    rows += [(r.section, str(r.status), r.result, r.figure, r.target) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    widths[2] = min(widths[2], 72)
    lines = [header] if header else []
    for i, row in enumerate(rows):
        cells = [c if len(c) <= w else c[:w - 1] + "…" for c, w in zip(row, widths)]
        lines.append(" | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)
