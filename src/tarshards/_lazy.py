"""Import a heavy module on first use (numpy costs ~0.1 s of start-up, which CLI tools feel), and
registry entries implemented by an optional module (torch image modes, ``.pth``, collation)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from .errors import MissingDependencyError


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


def names_of(package: str, module: str, submodules) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that hands out the names of ``module``, imported on
    first use; ``submodules`` (and dunder names) raise ``AttributeError`` at once, so that
    ``from package import submodule`` imports the submodule and nothing more."""
    skip = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or name in skip:
            raise AttributeError(name)
        try:
            return getattr(importlib.import_module(module), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


# declarations made before their registry exists (the package declares, then the registry's
# module is imported on first use): registry name -> [(names, module, extra, info)]
_PENDING: dict[str, list] = {}
_REGISTRIES: dict[str, "OptionalEntries"] = {}


def declare_optional(registry: str, names, module: str, *, extra=None, **info) -> None:
    """``OptionalEntries.declare`` on the registry named ``registry``
    (``"codecs.OPTIONAL_CODECS"``), now if it exists, else when it is made: so the package
    declares without importing the registry's module."""
    if registry in _REGISTRIES:
        _REGISTRIES[registry].declare(names, module, extra=extra, **info)
    else:
        _PENDING.setdefault(registry, []).append((names, module, extra, info))


class OptionalEntries:
    """Names in a registry whose implementation lives in a module imported on first use.

    A higher layer *declares* the names and the module (``declare``); importing that module
    registers the real entries. So a low module (the codec registry, the collation table) knows
    the names of optional parts without importing the module that implements them, and a missing
    dependency becomes a :class:`~tarshards.errors.MissingDependencyError` with an install hint.
    """

    def __init__(self, what: str, registry: str | None = None):
        self.what = what  # "image mode", "codec"...: for messages
        self._declared: dict[str, tuple[str, str | None, dict]] = {}
        if registry is not None:  # named: declare_optional reaches it, before or after
            _REGISTRIES[registry] = self
            for names, module, extra, info in _PENDING.pop(registry, ()):
                self.declare(names, module, extra=extra, **info)

    def declare(self, names, module: str, *, extra: str | None = None, **info) -> None:
        """``names`` are implemented by ``module`` (``pip install 'tarshards[extra]'``)."""
        for name in names:
            self._declared[name] = (module, extra, info)

    def __len__(self) -> int:
        return len(self._declared)

    def __contains__(self, name) -> bool:
        return name in self._declared

    def info(self, name) -> dict:
        return self._declared[name][2]

    def load(self, name) -> None:
        """Import the module that implements ``name`` (it registers the real entry)."""
        module, extra, _ = self._declared[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            if missing is None or missing == module or missing.startswith("tarshards"):
                raise
            hint = f"pip install 'tarshards[{extra}]'" if extra else f"pip install {missing}"
            raise MissingDependencyError(
                f"the {self.what} {name!r} needs the {missing} package: {hint}"
            ) from None
        # registered now (the module's import registers everything it declares)
        for other in [n for n, (m, _, _) in self._declared.items() if m == module]:
            del self._declared[other]
