"""``tarshards audit``: check a training's data-order ledger (``WebLoader(..., ledger=PATH)``).

The ledgers (one file per rank, a directory of them, or one file for all ranks) are read, the
epoch plans replayed, and, per epoch, the samples delivered twice or never are named (key, shard,
row), across restarts and world-size changes; a resume's replayed steps and declared padding
apart. The exit status is 1 when a sample came twice or never, 0 when every one came exactly
once, 2 when the ledgers or the data cannot be read. No sample data is read: the keys come from
the manifest and the shard indexes (SPEC, or the manifest the ledger names).
"""

from __future__ import annotations

import json
import os

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors

__all__ = ["audit_cmd"]


class _CannotAudit(click.ClickException):
    """The ledgers or the data cannot be read: exit status 2."""

    exit_code = 2


def _is_spec(arg: str) -> bool:
    """Whether the last argument names the data (a manifest, shards) rather than a ledger."""
    if os.path.isdir(arg) or arg.endswith(".jsonl"):
        return False
    low = arg.lower()
    return low.endswith(".json") or ".tar" in low or "{" in arg or "::" in arg


@click.command(
    "audit",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards audit ledger/ data/manifest.json     # every sample exactly once? (exit 1: no)",
        "tarshards audit 'ledger/rank-*.jsonl' --json",
        "tarshards audit ledger/ data/manifest.json --keys 1200   # the keys step 1200 held",
    ),
)
@click.argument("args", nargs=-1, required=True, metavar="LEDGER... [SPEC]")
@click.option(
    "--data",
    "data",
    default=None,
    metavar="SPEC",
    help="The data (a manifest, or shards with sidecar indexes); default: the last argument "
    "when it names data, else the manifest the ledger names.",
)
@click.option(
    "--keys",
    "keys",
    type=int,
    default=None,
    metavar="STEP",
    help="List the samples training step STEP held (steps counted from 0 across epochs and "
    "restarts), every rank's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--limit",
    type=int,
    default=1000,
    show_default=True,
    help="Name at most this many samples per epoch and kind.",
)
@handle_errors
def audit_cmd(args, data, keys, as_json, limit):
    """Check that every sample came exactly once, per epoch, from the ledgers of a training."""
    from ..plan.ledger import audit, read_ledger, step_samples

    args = list(args)
    if data is None and len(args) > 1 and _is_spec(args[-1]):
        data = args.pop()
    try:
        ledger = read_ledger(args)
        if keys is not None:
            step = step_samples(ledger, keys, data)
            if as_json:
                click.echo(json.dumps(step, indent=1))
                return
            click.echo(
                f"step {step['step']}: epoch {step['epoch']}, global batches from "
                f"{step['position']}, world size {step['world_size']}"
            )
            for r in step["ranks"]:
                if r["samples"] is None:
                    click.echo(f"rank {r['rank']}\tbatch {r['batch']}\t(give SPEC for the keys)")
                    continue
                for s in r["samples"]:
                    pad = "\tpad" if s["pad"] else ""
                    click.echo(f"{s['key']}\trank {r['rank']}\t{s['shard']}\trow {s['row']}{pad}")
            return
        report = audit(ledger, data, name_limit=limit)
    except (ValueError, FileNotFoundError) as exn:
        raise _CannotAudit(str(exn)) from None
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=1))
    else:
        click.echo(str(report))
    if not report.ok:
        raise SystemExit(1)
