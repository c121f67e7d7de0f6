"""`engram train --nproc N`: relaunch the same command under torchrun, one process per rank."""

from __future__ import annotations

import sys

from .data import prepare


def launch(cli_argv: list[str], nproc: int, data: list[str] | None, tokenizer: str) -> int:
    """Run `engram <cli_argv>` (without `--nproc`) under `torchrun --standalone --nproc_per_node=nproc`.

    The data is prepared here first, so the workers find it cached instead of tokenizing it
    `nproc` times. A failing worker prints its own one-line error; this reports how many failed,
    without torchrun's traceback. Returns the exit status (2 when every failure was a usage error).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    prepare(data, tokenizer)
    argv = [a for i, a in enumerate(cli_argv) if a != "--nproc" and (i == 0 or cli_argv[i - 1] != "--nproc")]
    argv = [a for a in argv if not a.startswith("--nproc=")]
    ns = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "engram.cli", *argv])
    try:
        run(ns)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print(f"engram: error: {len(e.failures)} of {nproc} training processes failed (exit codes {codes}); "
              "their messages are above", file=sys.stderr)
        return 2 if codes == [2] else 1
    return 0
