"""Lazy re-exports for a package's `__init__`: each public name loads its module on first use.

    __getattr__, __dir__ = lazy_exports(__name__, {"Monitor": "rldiag.collectors.monitor"}, __all__)

keeps `import rldiag` and `import rldiag.collectors` as light as their lightest module, while
`from rldiag import Monitor` works as usual (static tools read the package's TYPE_CHECKING imports).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(package: str, exports: Mapping[str, str],
                 public: Sequence[str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, loading `exports[name]` (a module) on first access."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
