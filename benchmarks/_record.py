"""Shared record helper of the benchmarks: append one run, with its environment, to a JSON record.

A record (docs/results/bench-*.json) is ``{"command": ..., "runs": [...]}``; each run is the benchmark's JSON
line plus ``argv``, ``environment`` (engram.utils.environment: machine, versions, git state) and a UTC ``date``.
The file is written aside and swapped in (engram.persist.write_json), so a crash leaves the old record or the new.
"""

import json
import sys
import time
from pathlib import Path


def append_run(path, command: str, run: dict, key: str = "runs") -> Path:
    """Append ``run`` to the record at ``path`` under ``key`` (created with ``command`` if the file is new)."""
    from engram.persist import write_json
    from engram.utils import environment

    rec = Path(path)
    data = json.loads(rec.read_text()) if rec.exists() else {"command": command, "runs": []}
    data.setdefault(key, []).append({**run, "argv": sys.argv[1:], "environment": environment(),
                                     "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    write_json(rec, data)
    print(f"appended to {rec}", file=sys.stderr)
    return rec
