"""The `engram` command: the parser, assembled from one module per job, and the error handler.

    model.py     demo, hash, spec, verify        the model and its hashing from a config; saved folders
    train.py     train, adapt, data, tokenizer   runs, and the data and tokenizer they read
    serve.py     eval, sample, serve, ask, crosscheck   use a model; talk to an OpenAI-compatible server
    edit.py      edit                            write facts into table rows (an overlay)
    analysis.py  gates, stats                    look inside a model and what its tables see
    options.py   the options several commands share (argparse parent parsers), the one grammar they keep
                 (lists, overlays, deprecated spellings: docs/cli.md), and what they load

and the applications three commands run, each whole beside its command (they are no part of the core, and
nothing else uses them): `demo.py` (the tutorial's demo LLM: `engram demo`), `verify.py` (`engram verify`: any
folder engram writes against its checksums), `client.py` (a client of OpenAI-compatible chat servers:
`engram ask`, `crosscheck`).

Other installed packages add commands through the `engram.cli` entry-point group: each entry is an
`add_commands(subparsers)` function, called after the library's own (`plugins`). This is how the evidence
experiments (`engram experiment`, `engram results`, in the separate `engram_experiments` package) join the
command without the library importing them.

Each command is one thin function over the library. Modules that import transformers, matplotlib or
torch.distributed (model, training, analysis, the launcher) are imported inside the commands that use
them, so `engram hash` and `engram --help` do not pay for them (~2 s for transformers alone).

Every expected failure (an `EngramError`, a bad value, a missing file or package) prints one line
`engram: error: ...` and exits with status 2; no Python traceback. Set ENGRAM_DEBUG=1 to see tracebacks.
Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from ..errors import EngramError
from . import analysis, edit, model, options, serve, train

EXPECTED_ERRORS = (EngramError, ValueError, OSError, ImportError, KeyError, FloatingPointError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram", description="Engram: conditional memory via hashed n-gram lookup")
    sub = p.add_subparsers(dest="command", required=True,  # (each command's help shows lists as the comma lists)
                           parser_class=functools.partial(argparse.ArgumentParser,
                                                          formatter_class=options.HelpFormatter))
    for group in (model, train, serve, edit, analysis):
        group.add_commands(sub)
    for add_commands in plugins():
        add_commands(sub)
    return p


def plugins() -> list:
    """The `add_commands` functions other installed packages register in the `engram.cli` entry-point group (by
    entry name, so the order of `engram --help` is stable). One that fails to import is left out with a warning:
    the library's own commands keep working."""
    from importlib.metadata import entry_points

    out = []
    for ep in sorted(entry_points(group="engram.cli"), key=lambda e: e.name):
        try:
            out.append(ep.load())
        except ImportError as e:
            print(f"engram: warning: commands of {ep.value} not loaded: {e}", file=sys.stderr)
    return out


def _warning_line(message, category, filename, lineno, file=None, line=None):
    print(f"engram: warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    warnings.showwarning = _warning_line  # one line, no source location
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram: interrupted", file=sys.stderr)
        return 130
    except EXPECTED_ERRORS as e:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"engram: error: {msg}", file=sys.stderr)
        return 2
