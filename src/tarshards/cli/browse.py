"""``tarshards browse``: look at a data set in the web browser.

Starts the read-only web application of :mod:`tarshards.web` on 127.0.0.1 (a free port when the
default one is taken), prints its URL and opens it in the browser; Ctrl-C stops it. Shards
without a manifest are indexed first (one sequential read each; ``--index-dir`` keeps the indexes
for the next time).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import warnings

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors, print_err, quiet_option

__all__ = ["browse_cmd"]

DEFAULT_PORT = 8765


@click.command(
    "browse",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards browse train.json",
        "tarshards browse 'shards/train-{0000..0147}.tar' --index-dir ~/.cache/train-idx",
        "tarshards browse s3://bucket/ds/manifest.json --port 9000 --no-open",
    ),
)
@click.argument("inputs", nargs=-1, required=True, metavar="SPEC...")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help=f"Port (default {DEFAULT_PORT}, or a free one when that is taken; 0: a free one).",
)
@click.option("--no-open", is_flag=True, help="Do not open the browser; only print the URL.")
@click.option(
    "--page-size",
    type=click.IntRange(1, 500),
    default=48,
    show_default=True,
    help="Samples per page of the grid.",
)
@click.option(
    "--index-dir",
    default=None,
    metavar="DIR",
    help="Where indexes of shards without a manifest go (kept and reused; default: a temporary "
    "directory removed at exit).",
)
@click.option(
    "--stats-samples",
    type=click.IntRange(0),
    default=256,
    show_default=True,
    help="Samples read and decoded for the statistics page.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Which samples those are.")
@click.option("-v", "--verbose", is_flag=True, help="Log each request on stderr.")
@quiet_option("No progress bar while indexing.")
@handle_errors
def browse_cmd(
    inputs: tuple[str, ...],
    host: str,
    port: int | None,
    no_open: bool,
    page_size: int,
    index_dir: str | None,
    stats_samples: int,
    seed: int,
    verbose: bool,
    quiet: bool,
) -> None:
    """Browse a data set (a manifest, or shards) in the web browser."""
    from ..web import BrowseData, BrowseServer, is_loopback

    spec = inputs[0] if len(inputs) == 1 else list(inputs)
    prog = click.get_current_context().command_path
    if not is_loopback(host):
        print_err(
            f"{prog}: warning: binding {host}, not a loopback address: every machine that "
            "reaches this one can read the data set"
        )
    data = BrowseData(
        spec, index_dir=index_dir, seed=seed, stats_samples=stats_samples, progress=not quiet
    )
    log = print_err if verbose else None
    try:
        try:
            server = BrowseServer(
                data,
                host=host,
                port=DEFAULT_PORT if port is None else port,
                page_size=page_size,
                log=log,
            )
        except OSError as exc:
            if port is not None or exc.errno != errno.EADDRINUSE:
                raise
            server = BrowseServer(data, host=host, port=0, page_size=page_size, log=log)
    except BaseException:
        data.close()
        raise
    with server:
        click.echo(f"{prog}: {len(data):,} samples in {data.num_shards:,} shards at {server.url}")
        click.echo("(Ctrl-C stops the server)")
        if not no_open and _have_a_browser():
            threading.Thread(target=_open_browser, args=(server.url,), daemon=True).start()
        elif not no_open:
            click.echo(
                f"(no display here: open the URL in a browser; from another machine, forward the "
                f"port first: ssh -L {server.port}:127.0.0.1:{server.port} THIS_HOST)"
            )
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def _have_a_browser() -> bool:
    """Whether a graphical browser can open here: on a machine without a display (a server
    reached over SSH) Python's webbrowser would start a text browser in this terminal."""
    if os.environ.get("BROWSER"):
        return True
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _open_browser(url: str) -> None:
    import webbrowser

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            webbrowser.open(url)
        except Exception:  # no browser here: the URL is printed
            pass
