"""Old spellings kept working, with a `DeprecationWarning` naming the new one.

    @renamed_keywords(backend="tier")
    def offload_tables(model, tier="mmap", ...): ...     # offload_tables(m, backend="disk") still works, and warns

    __getattr__ = moved = MovedNames(__name__)      # a module some names moved out of: `module.Name` still works,
    moved.add("Name", "new.home", Name)             # and warns, once whoever may import the new home registers it

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


class MovedNames:
    """A module's `__getattr__` for names that moved out of it: `old_module.Name` (and `from old_module import Name`)
    gives the moved object with a `DeprecationWarning` naming its new home.

    The new home is registered (`add`) by code that may import it, so a lower module keeps an old spelling of a name
    that now lives above it without importing upward: `engram.config.TrainConfig` (now `engram.training.config`'s)
    is registered by the root package `engram/__init__.py`, which every `import engram.config` runs first."""

    def __init__(self, module: str):
        self.module = module
        self.names: dict[str, tuple[str, object]] = {}

    def add(self, name: str, new_module: str, value) -> None:
        """`module.name` is `value`, now imported from `new_module`."""
        self.names[name] = (new_module, value)

    def __call__(self, name: str):
        if name in self.names:
            new_module, value = self.names[name]
            warnings.warn(f"{self.module}.{name} moved to {new_module}; use `from {new_module} import {name}`",
                          DeprecationWarning, stacklevel=2)
            return value
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
