"""The browser's HTML pages, made on the server from :class:`~tarshards.web.data.BrowseData`.

Plain HTML and the packaged ``style.css``; no JavaScript (the Content-Security-Policy allows
none). Every text that comes from the data set (keys, captions, JSON, field names, URLs) goes
through :func:`esc`, and every URL built from data through :func:`quote`.
"""

from __future__ import annotations

import html
import urllib.parse

from . import plots
from .data import (
    PLAYABLE_VIDEO,
    TEXT_LIMIT,
    BrowseData,
    SampleInfo,
    as_text,
    av_available,
    field_kind,
    pretty_json,
)

__all__ = ["esc", "grid_page", "message_page", "sample_page", "search_page", "stats_page"]

GRID_TEXT = 160  # characters of a text field shown in a grid cell
GRID_JSON = 400
# the first thumbnails of a page load at once (lazy ones start only after the page's load
# event: 100 ms later in Chromium here); the rest of a long page as it is scrolled to
EAGER_THUMBS = 48
LAZY = 'loading="lazy" '


def esc(text) -> str:
    """``text`` safe as HTML text and inside a quoted attribute."""
    return html.escape(str(text), quote=True)


def quote(text: str) -> str:
    return urllib.parse.quote(str(text), safe="")


def _layout(data: BrowseData, title: str, body: str, query: str = "") -> str:
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} \u2013 tarshards browse</title>"
        '<link rel="stylesheet" href="/static/style.css">'
        '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">'
        "</head><body>"
        '<header><a class="brand" href="/">tarshards browse</a>'
        f'<span class="dataset" title="{esc(data.spec)}">{esc(_short(str(data.spec), 60))}</span>'
        f'<span class="count">{len(data):,} samples in {data.num_shards:,} shards</span>'
        '<nav><a href="/">samples</a> <a href="/stats">statistics</a></nav>'
        '<form class="search" action="/search" method="get" role="search">'
        f'<input type="search" name="q" placeholder="key prefix" value="{esc(query)}" '
        'aria-label="key prefix"> <button type="submit">search</button></form>'
        '<form class="jump" action="/goto" method="get">'
        '<input type="number" name="i" min="0" placeholder="index" aria-label="sample index"> '
        '<button type="submit">go</button></form>'
        f"</header><main>{body}</main></body></html>\n"
    )


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else "\u2026" + text[-(n - 1) :]


def _cell(data: BrowseData, info: SampleInfo, sample: dict | None, lazy: bool = False) -> str:
    """One grid cell: the key, the first image as a thumbnail, text and JSON fields shortened,
    the other fields by size."""
    out = [
        f'<article class="cell" data-index="{info.index}">',
        f'<a class="key" href="/sample/{info.index}" title="{esc(info.key)}">'
        f'<span class="index">{info.index}</span> {esc(_short(info.key, 40))}</a>',
    ]
    shown_image = False
    rest = []
    for f in info.fields:
        kind = field_kind(f.name)
        value = None if sample is None else sample.get(f.name)
        if kind == "video":
            out.append(
                f'<a href="/sample/{info.index}">{_poster(info, f.name, "thumb", lazy=lazy)}</a>'
            )
            out.append(_media_line(data, info, f.name, f.size))
            continue
        if kind == "audio":
            rest.append(_media_line(data, info, f.name, f.size) + _audio(info, f.name, "none"))
            continue
        if kind == "image" and not shown_image:
            shown_image = True
            out.append(
                f'<a href="/sample/{info.index}"><img class="thumb" {LAZY if lazy else ""}'
                f'src="/thumb/{info.index}/{quote(f.name)}" alt="{esc(f.name)} of '
                f'{esc(info.key)}"></a>'
            )
            continue
        if value is not None and kind in ("text", "json", "binary") and f.size <= 65536:
            if kind == "json":
                text = pretty_json(value)
                if text is not None:
                    rest.append(
                        f'<pre class="json" title="{esc(f.name)}">'
                        f"{esc(_clip(text, GRID_JSON))}</pre>"
                    )
                    continue
            text = as_text(value)
            if text is not None and (kind != "binary" or f.size <= 256):
                rest.append(
                    f'<p class="text"><span class="field">{esc(f.name)}</span> '
                    f"{esc(_clip(text, GRID_TEXT))}</p>"
                )
                continue
        rest.append(
            f'<p class="size"><span class="field">{esc(f.name)}</span> '
            f"{esc(plots.human_bytes(f.size))}</p>"
        )
    out += rest
    out.append("</article>")
    return "".join(out)


def _duration(seconds: float) -> str:
    """``4.00 s``, ``1:05``, ``1:02:03``."""
    if seconds < 60:
        return f"{seconds:.2f} s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _media_line(data: BrowseData, info: SampleInfo, name: str, size: int) -> str:
    """``mp4 4.00 s, 64x48, 12 kB``: what the index (or the member's header) says."""
    got = data.media_info(info.index, name, info)
    bits = []
    if got.get("duration") is not None:
        bits.append(_duration(float(got["duration"])))
    if got.get("width") and got.get("height"):
        bits.append(f"{int(got['width'])}\u00d7{int(got['height'])}")
    if got.get("rate"):
        bits.append(f"{int(got['rate']):,} Hz")
    bits.append(plots.human_bytes(size))
    return (
        f'<p class="media"><span class="field">{esc(name)}</span> '
        f'<span class="duration">{esc(", ".join(bits))}</span></p>'
    )


def _audio(info: SampleInfo, name: str, preload: str) -> str:
    """An ``<audio>`` player of the field (served by the raw-field route, with byte ranges).
    ``preload``: ``"none"`` in the grid (a page of players fetches nothing until one plays),
    ``"metadata"`` on a sample page (the header: the duration shows)."""
    return (
        f'<audio class="player" controls preload="{preload}" '
        f'src="/api/sample/{info.index}/{quote(name)}" '
        f'aria-label="{esc(name)} of {esc(info.key)}"></audio>'
    )


def _poster(info: SampleInfo, name: str, cls: str, size: int | None = None, lazy: bool = False):
    """A video's poster frame (``/poster/I/FIELD``), or a placeholder where PyAV is missing."""
    alt = f"{name} of {info.key}"
    if not av_available():
        return (
            f'<div class="{cls} placeholder" role="img" aria-label="{esc(alt)}" '
            'title="no poster frame: PyAV is not installed">video</div>'
        )
    q = "" if size is None else f"?size={size}"
    return (
        f'<img class="{cls} poster" {LAZY if lazy else ""}'
        f'src="/poster/{info.index}/{quote(name)}{q}" alt="{esc(alt)}">'
    )


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _pager(page: int, pages: int, size: int, base: str = "/", query: str | None = None) -> str:
    extra = "" if query is None else f"&amp;q={esc(quote(query))}"

    def link(p: int, label: str, cls: str) -> str:
        if p < 0 or p >= pages or p == page:
            return f'<span class="{cls} disabled">{esc(label)}</span>'
        return f'<a class="{cls}" href="{base}?page={p}&amp;size={size}{extra}">{esc(label)}</a>'

    return (
        '<nav class="pager">'
        + link(0, "\u00ab first", "first")
        + link(page - 1, "\u2039 previous", "prev")
        + f'<span class="where">page {page:,} of {pages:,} (from 0: {page} / {pages - 1})</span>'
        + link(page + 1, "next \u203a", "next")
        + link(pages - 1, "last \u00bb", "last")
        + f'<form action="{base}" method="get" class="goto-page">'
        + (f'<input type="hidden" name="q" value="{esc(query)}">' if query is not None else "")
        + f'<input type="hidden" name="size" value="{size}">'
        + f'<input type="number" name="page" min="0" max="{pages - 1}" value="{page}" '
        'aria-label="page"> <button type="submit">page</button></form>'
        "</nav>"
    )


def _grid(data: BrowseData, indices) -> str:
    cells = []
    for k, i in enumerate(indices):
        info = data.info(i)
        try:
            sample = data.small_fields(info, 65536)
        except Exception as exc:  # a damaged sample shows its error, not a broken page
            cells.append(
                f'<article class="cell error" data-index="{i}"><a href="/sample/{i}">'
                f"{i} {esc(info.key)}</a><p>{esc(exc)}</p></article>"
            )
            continue
        cells.append(_cell(data, info, sample, lazy=k >= EAGER_THUMBS))
    return f'<section class="grid">{"".join(cells)}</section>'


def grid_page(data: BrowseData, page, size: int) -> str:
    page, pages, indices = data.page(page, size)
    body = (
        _pager(page, pages, size)
        + _grid(data, indices)
        + _pager(page, pages, size).replace('class="pager"', 'class="pager bottom"', 1)
    )
    return _layout(data, f"page {page}", body)


def search_page(data: BrowseData, query: str, page, size: int) -> str:
    if isinstance(page, str):
        page = data_page_number(page)
    total, found = data.search(query, start=page * size, limit=size)
    pages = max(1, -(-total // size))
    head = (
        f'<p class="result">{total:,} samples with keys starting with <code>{esc(query)}</code></p>'
    )
    if total == 0:
        return _layout(data, "search", head, query)
    pager = _pager(min(page, pages - 1), pages, size, "/search", query) if pages > 1 else ""
    return _layout(data, "search", head + pager + _grid(data, found), query)


def data_page_number(text: str) -> int:
    from .data import BadRequest

    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise BadRequest(f"bad page number {text[:40]!r} (an integer from 0)")
    return int(text)


def sample_page(data: BrowseData, i, page_size: int = 48) -> str:
    info = data.info(i)
    n = len(data)
    try:
        sample: dict | None = data.small_fields(info, 4 * TEXT_LIMIT)
        error = ""
    except Exception as exc:  # shown on the page: the index still says where it is
        sample, error = None, str(exc)
    nav = (
        '<nav class="pager">'
        + (
            f'<a class="prev" href="/sample/{info.index - 1}">\u2039 previous</a>'
            if info.index > 0
            else '<span class="prev disabled">\u2039 previous</span>'
        )
        + f'<a class="up" href="/?page={info.index // page_size}&amp;size={page_size}">'
        + "page of sample</a>"
        + (
            f'<a class="next" href="/sample/{info.index + 1}">next \u203a</a>'
            if info.index + 1 < n
            else '<span class="next disabled">next \u203a</span>'
        )
        + "</nav>"
    )
    facts = [
        ("index", f"{info.index:,} of {n:,}"),
        ("key", info.key),
        ("shard", f"{info.shard}: {info.shard_url}"),
        ("sample in shard", f"{info.position:,}"),
        ("byte offset (tar stream)", f"{info.offset:,}"),
        ("bytes read (shard file)", f"{info.file_offset:,} \u2013 {info.file_end:,}"),
        ("size of its fields", plots.human_bytes(info.size) + f" ({info.size:,} bytes)"),
    ]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts)
    fields = []
    for f in info.fields:
        value = None if sample is None else sample.get(f.name)
        if field_kind(f.name) in ("audio", "video"):  # read by the browser, by byte ranges
            preview = _media_preview(data, info, f.name, f.size)
        else:
            preview = _preview(info, f.name, f.size, value) if sample is not None else ""
        fields.append(
            f'<section class="field" id="field-{esc(f.name)}">'
            f'<h2>{esc(f.name)}</h2><table class="facts">'
            f"<tr><th>member</th><td>{esc(f.member)}</td></tr>"
            f"<tr><th>size</th><td>{f.size:,} byte{'' if f.size == 1 else 's'} "
            f"({esc(plots.human_bytes(f.size))})</td></tr>"
            f"<tr><th>header offset</th><td>{f.offset:,}</td></tr>"
            f"<tr><th>data offset</th><td>{f.data_offset:,}</td></tr>"
            f"<tr><th>checksum</th><td><code>{esc(f.checksum)}</code></td></tr>"
            "</table>"
            + preview
            + f'<p><a class="download" href="/api/sample/{info.index}/{quote(f.name)}">'
            "raw bytes</a></p></section>"
        )
    err = f'<p class="error">{esc(error)}</p>' if error else ""
    body = (
        nav
        + f'<h1 class="sample-key">{esc(info.key)}</h1>'
        + f'<table class="facts sample-facts">{rows}</table>'
        + err
        + "".join(fields)
    )
    return _layout(data, f"sample {info.index}", body)


def _media_preview(data: BrowseData, info: SampleInfo, name: str, size: int) -> str:
    line = _media_line(data, info, name, size)
    if field_kind(name) == "audio":
        return line + _audio(info, name, "metadata")
    out = line + _poster(info, name, "full", size=640)
    if name.rsplit(".", 1)[-1].lower() in PLAYABLE_VIDEO:  # a player where Chromium plays it
        out += (
            f'<video class="player" controls preload="none" '
            f'src="/api/sample/{info.index}/{quote(name)}"></video>'
        )
    return out


def _preview(info: SampleInfo, name: str, size: int, value) -> str:
    kind = field_kind(name)
    if kind == "image":  # made by the thumbnail route, which reads the field alone
        return (
            f'<img class="full" src="/thumb/{info.index}/{quote(name)}?size=640" '
            f'alt="{esc(name)} of {esc(info.key)}">'
        )
    if value is None:
        return f'<p class="size">{size:,} bytes: too large to show here</p>'
    if kind == "json":
        text = pretty_json(value)
        if text is not None:
            return f'<pre class="json">{esc(_clip(text, TEXT_LIMIT))}</pre>'
    text = as_text(value) if size <= 4 * TEXT_LIMIT else None
    if text is not None:
        return f'<pre class="text">{esc(_clip(text, TEXT_LIMIT))}</pre>'
    return f'<p class="size">binary, {size:,} bytes</p>'


def stats_page(data: BrowseData) -> str:
    st = data.index_stats()
    parts = ["<h1>Statistics</h1><h2>From the index (no sample data read)</h2>"]
    parts.append(
        f"<p>{st['samples']:,} samples in {st['shards']:,} shards; "
        f"{sum(f['bytes'] for f in st['fields'].values()):,} bytes of fields.</p>"
    )
    per = st["samples_per_shard"]
    if len(per) <= 60:
        parts.append(plots.bar_chart(range(len(per)), per, "samples per shard", ylabel="samples"))
    else:
        import numpy as np

        from .data import histogram

        parts.append(
            plots.histogram_chart(histogram(np.array(per)), "samples per shard", ylabel="shards")
        )
    rows = "".join(
        f"<tr><td>{esc(name)}</td><td>{f['count']:,}</td><td>{esc(plots.human_bytes(f['bytes']))}"
        f"</td><td>{f['min']:,}</td><td>{f['mean']:,.1f}</td><td>{f['max']:,}</td></tr>"
        for name, f in st["fields"].items()
    )
    parts.append(
        '<table class="fields"><tr><th>field</th><th>samples</th><th>bytes</th>'
        f"<th>min size</th><th>mean size</th><th>max size</th></tr>{rows}</table>"
    )
    parts.append('<div class="plots">')
    parts.append(plots.histogram_chart(st["sample_bytes"], "bytes per sample", unit="bytes"))
    mps = st["members_per_sample"]
    parts.append(plots.bar_chart(list(mps), list(mps.values()), "fields per sample"))
    for name, f in st["fields"].items():
        parts.append(plots.histogram_chart(f["histogram"], f"size of {name}", unit="bytes"))
    parts.append("</div>")
    meta = st.get("meta") or {}
    if meta:
        parts.append(
            "<h3>Per-sample metadata columns (from the index)</h3>"
            '<table class="fields"><tr><th>column</th><th>samples</th><th>missing</th>'
            "<th>min</th><th>mean</th><th>max</th></tr>"
            + "".join(
                f"<tr><td>{esc(name)}</td><td>{m['count']:,}</td><td>{m['missing']:,}</td>"
                + "".join(
                    f"<td>{'' if m[k] is None else esc(plots.number(m[k]))}</td>"
                    for k in ("min", "mean", "max")
                )
                + "</tr>"
                for name, m in meta.items()
            )
            + "</table>"
        )
        parts.append('<div class="plots meta">')
        for name, m in meta.items():
            parts.append(plots.histogram_chart(m["histogram"], f"metadata: {name}"))
        parts.append("</div>")
    ds = data.data_stats()
    parts.append(
        f"<h2>From {ds['samples_read']:,} samples read and decoded (seed {ds['seed']})</h2>"
    )
    if ds["unreadable"]:
        parts.append(f'<p class="error">{ds["unreadable"]} samples could not be read.</p>')
    parts.append('<div class="plots">')
    for name, im in ds["images"].items():
        parts.append(
            plots.scatter(im["sizes"], f"{name}: image sizes", xlabel="width", ylabel="height")
        )
        parts.append(plots.histogram_chart(im["width"], f"{name}: width (pixels)"))
        parts.append(plots.histogram_chart(im["height"], f"{name}: height (pixels)"))
        modes = im["modes"]
        parts.append(plots.bar_chart(list(modes), list(modes.values()), f"{name}: image modes"))
    for name, counts in ds["classes"].items():
        parts.append(
            plots.bar_chart(list(counts), list(counts.values()), f"{name}: classes", max_bars=100)
        )
    for name, hist in ds["text_lengths"].items():
        parts.append(plots.histogram_chart(hist, f"{name}: length (characters)"))
    for name, columns in ds["json_columns"].items():
        for key, hist in columns.items():
            parts.append(plots.histogram_chart(hist, f"{name}: {key}"))
    parts.append("</div>")
    return _layout(data, "statistics", "".join(parts))


def message_page(title: str, message: str) -> str:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<title>{esc(title)}</title><link rel="stylesheet" href="/static/style.css"></head>'
        f'<body><main><h1>{esc(title)}</h1><p class="error">{esc(message)}</p>'
        '<p><a href="/">back to the samples</a></p></main></body></html>\n'
    )
