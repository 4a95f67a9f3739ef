"""``tarpcat``: read several shards at once and interleave their samples into one tar stream.

Each open shard is read by a thread into a small bounded queue; the main thread takes one sample
from each open shard in turn (round robin), so the output order depends only on the inputs and
``parallel``. When a shard ends, the next input takes its place. Threads suit this job: the waiting
is on storage and network, and the samples are passed along as bytes without copies.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Callable, Generator, Iterator

import click

from ..errors import TarshardsError
from ..pipeline.stages import shuffle as shuffle_stage
from ..write.writer import TarWriter
from ._common import (
    CONTEXT_SETTINGS,
    Progress,
    check_stdout_not_tty,
    collect_inputs,
    count_option,
    error_handler,
    examples,
    files_from_option,
    handle_errors,
    inputs_argument,
    members_of,
    on_error_option,
    output_dest,
    output_option,
    quiet_option,
    shard_reader,
    shuffle_options,
)

__all__ = ["interleave", "pcat_cmd"]

_END = object()
_QUEUE_SIZE = 64


class _Failed:
    __slots__ = ("exn",)

    def __init__(self, exn: BaseException):
        self.exn = exn


class _Reader:
    """A thread reading one shard into a bounded queue."""

    def __init__(self, url: str, stop: threading.Event):
        self.url = url
        self.queue: queue.Queue = queue.Queue(_QUEUE_SIZE)
        self.stop = stop
        self.thread = threading.Thread(target=self._run, name=f"tarpcat:{url}", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        samples = shard_reader(self.url)
        try:
            for sample in samples:
                if not self._put(sample):
                    return
            self._put(_END)
        except BaseException as exn:  # noqa: BLE001 - handed to the main thread
            self._put(_Failed(exn))
        finally:
            samples.close()


def interleave(
    urls: list[str], parallel: int, handler: Callable[[BaseException], bool]
) -> Generator[dict, None, None]:
    """Samples of ``urls``, ``parallel`` shards at a time, taken round robin."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    stop = threading.Event()
    pending = iter(urls)
    active: list[_Reader] = []
    try:
        for url in pending:
            active.append(_Reader(url, stop))
            if len(active) >= parallel:
                break
        i = 0
        while active:
            if i >= len(active):
                i = 0
            reader = active[i]
            item = reader.queue.get()
            if item is _END or isinstance(item, _Failed):
                if isinstance(item, _Failed):
                    if not isinstance(item.exn, TarshardsError):
                        raise item.exn
                    if not handler(item.exn):
                        return
                nxt = next(pending, None)
                if nxt is None:
                    del active[i]
                else:
                    active[i] = _Reader(nxt, stop)
                continue
            yield item
            i += 1
    finally:
        stop.set()


@click.command(
    "pcat",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarpcat -p 8 'https://host/data-{0000..0099}.tar' > all.tar",
        "tarpcat -p 4 --shuffle 5000 --seed 3 'train-{00..15}.tar' | tarsplit -s 1e9 -o mixed",
    ),
)
@inputs_argument
@click.option(
    "-p",
    "--parallel",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Read N inputs at a time.",
)
@output_option()
@count_option("Write")
@shuffle_options
@files_from_option
@on_error_option()
@quiet_option()
@handle_errors
def pcat_cmd(
    inputs: tuple[str, ...],
    parallel: int,
    output: str,
    count: int | None,
    shuffle: int,
    seed: int,
    listfile: str | None,
    on_error: str,
    quiet: bool,
) -> None:
    """Read INPUTS N at a time in parallel and interleave their samples into one tar stream."""
    urls = collect_inputs(inputs, listfile)
    check_stdout_not_tty(output)
    source = interleave(urls, parallel, error_handler(on_error))
    samples: Iterator[dict] = source
    if shuffle > 1:
        samples = shuffle_stage(samples, shuffle, seed=seed)
    if count is not None:
        samples = itertools.islice(samples, count)
    try:
        with (
            Progress(quiet, "tarpcat") as bar,
            TarWriter(output_dest(output), encoder=False) as sink,
        ):
            for sample in bar.wrap(samples):
                sink.write_members(members_of(sample))
    finally:
        source.close()  # stops the reader threads
