"""Register "bamboo" in each Lightning namespace when that namespace is imported, not before.

``import lightning_bamboo`` must make ``Trainer(strategy="bamboo")`` work, but importing
Lightning (seconds) just to register would slow down every process that only needs, say,
the membership store or the simulator. So registration happens at once for a namespace that
is already imported, and otherwise right after its ``strategies`` package finishes importing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def register(namespace: str) -> None:
    from lightning_bamboo.strategy import strategy_class

    registry = sys.modules[f"{namespace}.strategies"].StrategyRegistry
    strategy_class(namespace).register_strategies(registry)  # type: ignore[attr-defined]


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<namespace>.strategies`` through the other finders and registers once it has run."""

    def __init__(self) -> None:
        self._targets = {f"{ns}.strategies": ns for ns in NAMESPACES}
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._targets or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        self._real = getattr(self, "_real", {})
        self._real[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._real[spec.name].create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: ModuleType) -> None:
        name = module.__spec__.name  # type: ignore[union-attr]
        self._real[name].exec_module(module)  # type: ignore[attr-defined]
        # the namespace's top package may still be importing; register once this module is complete
        register(self._targets[name])


_finder = _RegisterAfterImport()


def install() -> None:
    for namespace in NAMESPACES:
        if f"{namespace}.strategies" in sys.modules:
            register(namespace)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
