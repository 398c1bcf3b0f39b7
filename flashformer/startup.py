"""What keeps a process's start cheap (docs/benchmarks.md, "Cold start"):

- re-exports imported at their first use, so that `import flashformer` and the `flashformer`
  command pay only for the rooms they reach (`import flashformer` alone imports no torch,
  `flashformer generate` no training, serving or plotting code):

      lazy_exports(__name__, {"load": "flashformer.checkpoints.loading", ...})   # in an __init__.py

  A name's first read imports the module that defines it and keeps the value on the package,
  so every later read is a plain attribute read.

- the garbage collector paused while start-up allocates (`with paused_gc(): ...`): importing
  torch and the rooms, and loading a model, create hundreds of thousands of objects that all
  live on, and each full collection on the way walks all of them again, for nothing.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module whose re-exported names are imported when first read."""

    _exports: dict[str, str]  # name -> the module that defines it

    def __getattr__(self, name: str):  # only for names not yet on the module
        module = self.__dict__.get("_exports", {}).get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value) -> None:
        # The import system binds a subpackage on its parent when it first loads it. Where a
        # re-export has the subpackage's name (flashformer.attention, the function, beside the
        # room flashformer/attention/), the re-export keeps the name, as when it was imported eagerly.
        if isinstance(value, types.ModuleType) and name in self._exports:
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted({*self.__dict__, *self._exports})


def lazy_exports(package: str, exports: dict[str, str]) -> None:
    """Make the package `package` (its __init__ calls this with __name__) export each name of
    `exports` from its module, imported at the name's first read."""
    module = sys.modules[package]
    module.__dict__["_exports"] = dict(exports)
    module.__class__ = LazyPackage


@contextlib.contextmanager
def paused_gc(freeze: bool = False):
    """No cyclic garbage collection inside (reference counting frees as ever): an import of
    torch and the rooms ran 500 collections, 0.2-0.5 s of a cold start, that found next to
    nothing to free. freeze: move every object alive at the end out of the collector's view
    (gc.freeze), so that later full collections do not walk the modules and the model again.
    A collector already paused by the caller stays paused."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
