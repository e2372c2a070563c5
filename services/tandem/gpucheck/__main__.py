"""``python -m tandem.gpucheck [--dry-run]``: run the device check, print its table.

Exit status: 0 all passed; 1 a failure or a missed target; 2 no CUDA device
(without ``--dry-run``); 3 nothing passed (everything skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.gpucheck",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="run every section on the CPU with tiny sizes (Triton interpreted): "
                             "checks the check's own plumbing, judges no target")
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help="run only these sections (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checkpoints are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.dry_run:  # before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from tandem.gpucheck import report
    from tandem.gpucheck.context import DRY_SIZES, GPU_SIZES, CheckContext
    from tandem.gpucheck.sections import run

    if not args.dry_run and not torch.cuda.is_available():
        print(report.table([report.Result("device", report.Status.FAIL, "no CUDA device: nothing "
                                          "can be checked (use --dry-run on a CPU)")]))
        return report.NO_DEVICE
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    if args.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        ctx = CheckContext(dry_run=args.dry_run, device=device, workdir=args.workdir or Path(tmp),
                           sizes=DRY_SIZES if args.dry_run else GPU_SIZES)
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        results = run(ctx, set(args.only) if args.only else None,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    code = report.exit_code(results)
    verdict = {report.OK: "all passed", report.FAILED: "FAILED",
               report.NOTHING_PASSED: "FAILED: nothing passed"}[code]
    header = (f"tandem gpu-check{' (dry run, CPU)' if args.dry_run else ''}: {verdict} "
              f"in {time.monotonic() - started:.0f} s")
    print(report.table(results, header=header), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
