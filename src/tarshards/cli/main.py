"""The ``tarshards`` command group and the entry points of the tool scripts.

Each tool is one click command in its own module (``cat.py`` holds ``tarscat``...), installed
both as its own script (``tarscat``) and as a subcommand (``tarshards cat``). This module only
registers them: adding a command is one line in :data:`COMMANDS` (and, for a script of its own,
one line in ``pyproject.toml`` calling :func:`script`). A command's module is imported when the
command runs, so a tool starts without loading the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import click

from ._common import CONTEXT_SETTINGS, examples

__all__ = ["COMMANDS", "group", "load_command", "main", "script"]

#: subcommand -> (script name or None, "module:command object"); the group lists them in order
COMMANDS: dict[str, tuple[str | None, str]] = {
    "cat": ("tarscat", "tarshards.cli.cat:cat_cmd"),
    "tsv": ("tar2tsv", "tarshards.cli.tsv:tsv_cmd"),
    "split": ("tarsplit", "tarshards.cli.split:split_cmd"),
    "show": ("tarshow", "tarshards.cli.show:show_cmd"),
    "proc": ("tarproc", "tarshards.cli.proc:proc_cmd"),
    "pcat": ("tarpcat", "tarshards.cli.pcat:pcat_cmd"),
    "sort": ("tarsort", "tarshards.cli.sort:sort_cmd"),
    "check": ("tarcheck", "tarshards.cli.check:check_cmd"),
    "map": (None, "tarshards.cli.map_cmd:map_cmd"),
    "bench": (None, "tarshards.cli.bench:bench_cmd"),
    "index": (None, "tarshards.cli.index:index_cmd"),
    "browse": (None, "tarshards.cli.browse:browse_cmd"),
    "convert": (None, "tarshards.cli.convert:convert_cmd"),
    "view": (None, "tarshards.cli.view:view_cmd"),
    "dedup": (None, "tarshards.cli.dedup:dedup_cmd"),
    "columns": (None, "tarshards.cli.columns:columns_cmd"),
    "join": (None, "tarshards.cli.join:join_cmd"),
    "audit": (None, "tarshards.cli.audit:audit_cmd"),
    "info": (None, "tarshards.cli.info:info_cmd"),
}


def load_command(name: str) -> click.Command:
    """The click command registered as ``name`` (imports its module)."""
    target = COMMANDS[name][1]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class _Commands(MutableMapping):
    """The group's commands: the :data:`COMMANDS` table, each imported on first access."""

    def __init__(self, table: dict):
        self._table = table
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            if name not in self._table:
                raise KeyError(name)
            self._loaded[name] = load_command(name)
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:  # group.add_command
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._table
        yield from (n for n in self._loaded if n not in self._table)

    def __len__(self) -> int:
        return len(set(self._table) | set(self._loaded))


@click.group(
    "tarshards",
    commands=_Commands(COMMANDS),
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards cat -c 10 in.tar > small.tar      # same as: tarscat -c 10 in.tar",
        "tarshards check 'train-{0000..0147}.tar'",
    ),
)
def group() -> None:
    """Tools for datasets stored as sharded tar files (WebDataset format).

    Each subcommand but map and bench is also installed as its own script: cat=tarscat, tsv=tar2tsv,
    split=tarsplit, show=tarshow, proc=tarproc, pcat=tarpcat, sort=tarsort, check=tarcheck.
    """


def main(argv: Sequence[str] | None = None) -> Any:
    """``tarshards SUBCOMMAND ...``"""
    return group.main(args=argv, prog_name="tarshards")


def script(name: str) -> Callable[[Sequence[str] | None], Any]:
    """The entry point of the script of subcommand ``name`` (``tarscat`` for ``cat``)."""
    prog = COMMANDS[name][0] or f"tarshards {name}"

    def run(argv: Sequence[str] | None = None) -> Any:
        return load_command(name).main(args=argv, prog_name=prog)

    run.__name__ = prog.replace(" ", "_")
    run.__doc__ = f"The ``{prog}`` script (``tarshards {name}``)."
    return run


# the console scripts of pyproject.toml
tarscat = script("cat")
tar2tsv = script("tsv")
tarsplit = script("split")
tarshow = script("show")
tarproc = script("proc")
tarpcat = script("pcat")
tarsort = script("sort")
tarcheck = script("check")

if __name__ == "__main__":  # pragma: no cover
    main()
