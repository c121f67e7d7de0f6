"""Old spellings kept working, with a `DeprecationWarning` naming the new one.

    @renamed_keywords(backend="tier")
    def offload_tables(model, tier="mmap", ...): ...     # offload_tables(m, backend="disk") still works, and warns

    __getattr__ = moved = MovedNames(__name__)      # a module some names moved out of: `module.Name` still works,
    moved.add("Name", "new.home", Name)             # and warns, once whoever may import the new home registers it

(The CLI's old spellings print one line on stderr instead, `engram: warning: OLD is deprecated; use NEW`:
`cli.options.say_deprecated`, through `DeprecatedFlag` (a renamed flag or positional) and `ListFlag` (a list
given space-separated or by repeating its flag); docs/cli.md lists them.)
"""

from __future__ import annotations

import functools
import warnings


def renamed_keywords(**old_to_new: str):
    """Decorator: the function's keyword `new` is also accepted as `old` (each `old=new` pair), with a
    `DeprecationWarning` pointing at the caller; giving both is a `TypeError`."""

    def wrap(fn):
        # a constructor is named by its class: `NgramHashMapping(backend=...)`, not `__init__(backend=...)`
        name = fn.__qualname__.removesuffix(".__init__") if fn.__name__ == "__init__" else fn.__name__

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {new}= and its deprecated spelling {old}=")
                    warnings.warn(f"{name}({old}=...) is deprecated; use {new}=", DeprecationWarning,
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

    def add(self, name: str, new_module: str, value, new_name: str | None = None) -> None:
        """`module.name` is `value`, now imported from `new_module` (as `new_name`, where it was renamed too)."""
        self.names[name] = (new_module, value, new_name or name)

    def __call__(self, name: str):
        if name in self.names:
            new_module, value, new_name = self.names[name]
            where = f"was renamed {new_name}" if new_module == self.module else f"moved to {new_module}"
            warnings.warn(f"{self.module}.{name} {where}; use `from {new_module} import {new_name}`",
                          DeprecationWarning, stacklevel=2)
            return value
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
