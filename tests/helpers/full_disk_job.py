"""One rank of a ``lowbit`` CLI job on a disk that fills up (tests/streamed/test_streamed_full_disk.py):

    python full_disk_job.py LOGS RANK SITE ARGS...

The rank RANK (-1: none) refuses its first write of the file SITE (helpers.full_disk.FullDisk);
every rank runs ``lowbit ARGS``. Rank r's stderr goes to LOGS/rank<r>.err and the CLI's exit code
to LOGS/rank<r>.rc; the process itself exits 0, so torchrun never ends a rank that is still
reporting because another has exited."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    logs, failing, site, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    rank = int(os.environ.get("RANK", "0"))
    err = open(logs / f"rank{rank}.err", "w")
    os.dup2(err.fileno(), 2)  # what this rank prints, tracebacks included
    import pytest

    from helpers.full_disk import FullDisk
    from lowbit.cli import main

    if rank == failing:
        FullDisk(pytest.MonkeyPatch(), fail_at=1, only=site)
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the log, as the CLI would not
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    with open(logs / f"rank{rank}.rc", "w") as f:
        f.write(str(code))
