"""Old spellings kept working, with a `DeprecationWarning` naming the new one.

    @renamed_keywords(backend="tier")
    def offload_tables(model, tier="mmap", ...): ...     # offload_tables(m, backend="disk") still works, and warns

(The CLI's deprecated flags are `cli.options.DeprecatedFlag`: one line on stderr.)
"""

from __future__ import annotations

import functools
import warnings


def renamed_keywords(**old_to_new: str):
    """Decorator: the function's keyword `new` is also accepted as `old` (each `old=new` pair), with a
    `DeprecationWarning` pointing at the caller; giving both is a `TypeError`."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {new}= and its deprecated spelling {old}=")
                    warnings.warn(f"{fn.__name__}({old}=...) is deprecated; use {new}=", DeprecationWarning,
                                  stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap
