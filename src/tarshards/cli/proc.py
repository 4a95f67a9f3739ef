"""``tarproc``: run a shell command on every sample.

Each sample is unpacked into a fresh temporary directory as ``BASE.EXT`` files (``BASE`` is the
last path component of the key, so ``train/n0123_17`` gives ``n0123_17.jpg``), the command runs
there with ``$KEY`` set to the full key, and the files present afterwards form the output sample
under the original key: ``BASE.EXT`` becomes field ``EXT``, any other file ``NAME`` becomes field
``NAME``. Hidden files, ``__*`` files and subdirectories are not collected.

``-p N`` runs N commands at a time (threads waiting on subprocesses, through
:mod:`concurrent.futures`) with at most ``2N`` samples in flight, so memory stays bounded.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
from typing import Iterator

import click

from ..errors import CommandError
from ..parallel import ShellSampleFn
from ..write.writer import TarWriter
from ._common import (
    CONTEXT_SETTINGS,
    DataError,
    Progress,
    check_stdout_not_tty,
    collect_inputs,
    count_option,
    examples,
    handle_errors,
    inputs_argument,
    members_of,
    on_error_option,
    output_dest,
    output_option,
    print_err,
    quiet_option,
    read_samples,
)

__all__ = ["process_sample", "proc_cmd"]


def process_sample(
    sample: dict, command: str, tmpdir: str | None = None, verbose: bool = False
) -> list[tuple[str, bytes]]:
    """Run ``command`` on one sample; returns the output members (empty: sample dropped)."""
    out = ShellSampleFn(command, tmpdir=tmpdir, verbose=verbose)(sample)
    return [] if out is None else members_of(out)


def _results(samples, command, parallel, ordered, tmpdir, verbose):
    """Yield ``(sample, members or CommandFailed)``, keeping input order when ``ordered``."""
    with cf.ThreadPoolExecutor(max_workers=parallel) as pool:
        inflight: collections.deque = collections.deque()
        it = iter(samples)

        def submit() -> bool:
            sample = next(it, None)
            if sample is None:
                return False
            inflight.append((sample, pool.submit(process_sample, sample, command, tmpdir, verbose)))
            return True

        try:
            for _ in range(2 * parallel):
                if not submit():
                    break
            while inflight:
                if ordered:
                    sample, fut = inflight.popleft()
                else:
                    cf.wait([f for _, f in inflight], return_when=cf.FIRST_COMPLETED)
                    idx = next(i for i, (_, f) in enumerate(inflight) if f.done())
                    sample, fut = inflight[idx]
                    del inflight[idx]
                try:
                    outcome = fut.result()
                except CommandError as exn:
                    outcome = exn
                yield sample, outcome
                submit()
        finally:
            for _, fut in inflight:
                fut.cancel()


@click.command(
    "proc",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarproc -p 5 -c 'mogrify -resize 256x256 *.jpg' small.tar > out.tar",
        "tarproc -p 8 -c 'gzip -9 *.json' in.tar -o out.tar   # field json -> json.gz",
        "tarproc -c 'wc -c < *.txt > $(basename $KEY).len' -e skip in.tar -o out.tar",
    ),
)
@inputs_argument
@click.option(
    "-c", "--command", required=True, help="Shell command run in each sample's directory."
)
@click.option(
    "-p",
    "--parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run N commands at a time.",
)
@click.option("--unordered", is_flag=True, help="Write samples as they finish, not in input order.")
@on_error_option("command failure", "drop its sample")
@output_option()
@count_option("Process", "-n", "--count")
@click.option("--tmpdir", default=None, metavar="DIR", help="Where the per-sample directories go.")
@click.option("-v", "--verbose", is_flag=True, help="Copy the commands' output to stderr.")
@quiet_option()
@handle_errors
def proc_cmd(
    inputs: tuple[str, ...],
    command: str,
    parallel: int,
    unordered: bool,
    on_error: str,
    output: str,
    count: int | None,
    tmpdir: str | None,
    verbose: bool,
    quiet: bool,
) -> None:
    """Run a shell command on each sample of INPUTS; the files it leaves form the output sample.

    The sample's fields are files BASE.EXT in a fresh directory, $KEY holds the key.
    """
    urls = collect_inputs(inputs)
    check_stdout_not_tty(output)
    samples: Iterator[dict] = read_samples(urls, on_error)
    if count is not None:
        samples = itertools.islice(samples, count)
    prog = click.get_current_context().command_path
    failed = 0
    with Progress(quiet, "tarproc") as bar, TarWriter(output_dest(output), encoder=False) as sink:
        for sample, outcome in _results(samples, command, parallel, not unordered, tmpdir, verbose):
            bar.update()
            if isinstance(outcome, CommandError):
                tail = outcome.stderr.decode("utf-8", "replace").strip()
                if tail:
                    print_err("\n".join(tail.splitlines()[-20:]))
                what = (
                    f"command exited with status {outcome.status} on sample "
                    f"{sample['__key__']!r} (shard {outcome.url})"
                )
                if on_error == "raise":
                    raise DataError(what)
                failed += 1
                print_err(f"{prog}: warning: skipped: {what}")
                continue
            if outcome:
                sink.write_members(outcome)
    if failed:
        print_err(f"{prog}: {failed} sample(s) skipped because the command failed")
