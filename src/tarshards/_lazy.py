"""Import a heavy module on first use (numpy costs ~0.1 s of start-up, which CLI tools feel)."""

from __future__ import annotations

import importlib


class LazyModule:
    """Stands in for ``module`` in ``namespace[alias]`` until an attribute is first read; then the
    real module replaces it there, so later uses cost nothing extra."""

    def __init__(self, module: str, namespace: dict, alias: str):
        self._module = module
        self._namespace = namespace
        self._alias = alias

    def __getattr__(self, attr: str):
        mod = importlib.import_module(self._module)
        self._namespace[self._alias] = mod
        return getattr(mod, attr)
