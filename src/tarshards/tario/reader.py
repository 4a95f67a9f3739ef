"""The streaming member reader: ``(name, data, offset)`` for each regular member of a tar stream.

A C fast path (``_speedups.scan_members``) for plain ustar members lying wholly in the buffer,
the same fast path in Python, and the general path for everything else (extended headers, GNU
long names, sparse members, members spanning reads, the end of the archive). The Python code is
the reference: the C loop stops, rather than raises, at anything unusual.
"""

from __future__ import annotations

import warnings
from typing import BinaryIO, Iterable, Iterator

from ..errors import CompressionError, HeaderError, TarshardsWarning, TruncatedShardError
from .buffer import (
    COPY_WINDOW,
    _Buffer,
    _DirectBuffer,
    _read_data,
    reader_buffer,
    tar_byte_source,
)
from .headers import (
    _DRAIN_LIMIT,
    _GNU_LONGNAME,
    _GNU_SPARSE,
    _MAX_META,
    _META,
    _NO_DATA,
    _PAX,
    _PAX_GLOBAL,
    _PAX_READ_KEYS,
    _REGULAR,
    _SPARSE_KEYS,
    _ZERO_BLOCK,
    BLOCK,
    CHUNK_SIZE,
    _bad_header,
    _chk_value,
    _first_bad_header,
    _header_sum,
    _member_name,
    _merge_pax,
    _nts,
    _parse_pax,
    _pax_size,
    _pending_name,
    _size_field,
    checksum_ok,
    parse_octal,
    size_number,
)
from .sparse import _old_gnu_sparse_map, _pax_unsparse, _unsparse

try:  # optional C accelerator (_speedups, see _c/); the Python code below is the reference
    from .._speedups import scan_members as _scan_members
except ImportError:  # pragma: no cover - built by default; pure Python works the same
    _scan_members = None
try:  # a build whose scan reads members straight into their bytes (DirectFile sources)
    from .._speedups import SCAN_DIRECT as _SCAN_DIRECT
except ImportError:  # pragma: no cover - an older build: such sources read into the buffer
    _SCAN_DIRECT = 0


def iter_tar(
    chunks: Iterable[bytes],
    source=None,
    *,
    verify: bool = True,
    drain: bool = True,
    offset: int = 0,
    copy: bool = True,
) -> Iterator[tuple[str, bytes | memoryview, int]]:
    """Yield ``(name, data, offset)`` for each regular member of a tar byte stream.

    ``chunks`` is an iterable of bytes (see :func:`read_chunks` and :func:`decompressed_chunks`).
    A member's ``offset`` is the position of its first header block in the uncompressed stream,
    counted from ``offset`` (where the input starts in the tar stream; 0 by default).
    Directories, links, devices and other non-regular members are skipped; GNU sparse members
    are rebuilt. The stream ends at the end-of-archive marker (or at EOF on a block boundary).
    ``verify`` checks header checksums. A truncated or malformed stream raises a
    :class:`ShardFormatError` (:class:`TruncatedShardError`, :class:`HeaderError`,
    :class:`CompressionError`) naming ``source``, the member and the byte offset, after every
    complete member before the damage has been yielded.

    ``copy=False`` (zero-copy): the members of a memory-mapped local plain file (what
    :func:`tar_byte_source` makes of ``open(path, "rb")``) are read-only ``memoryview`` slices
    of the map instead of ``bytes`` copies; any other input (gzip, zstd, HTTP, pipes, chunk
    iterables) yields ``bytes`` as usual, and so do sparse members. A view keeps the map alive
    (the reader lets go of its reference when it ends, and the last view unmaps it); the file
    must not be truncated or rewritten in place while views of it are alive (as with any map:
    a page past a new end kills the process with SIGBUS). ``bytes(view)`` copies a member out.
    """
    for batch in iter_tar_batches(
        chunks, source, verify=verify, drain=drain, offset=offset, copy=copy
    ):
        yield from batch


def plain_run(buf, lo: int, hi: int) -> list | None:
    """The members ``(name, bytes, offset)`` of bytes ``lo:hi`` of ``buf`` (a map of a local
    plain tar; offsets are positions in it) in one C call, when the run is members the fast path
    reads (plain ustar members, or behind harmless pax / long-name headers), all with valid
    header checksums, and ends exactly at ``hi``; else ``None``: read it with
    :func:`iter_tar_batches`, which raises the right error where there is one. For a reader that
    knows where its samples start and end (the planned path's lists)."""
    if _scan_members is None:
        return None
    members, pos = _scan_members(buf, lo, 0, hi, hi, None, True, None)
    return members if pos == hi else None


def iter_tar_batches(
    chunks: Iterable[bytes],
    source=None,
    *,
    verify: bool = True,
    drain: bool = True,
    accelerate: bool = True,
    offset: int = 0,
    copy: bool = True,
    chunk_size: int = CHUNK_SIZE,
    _layout: list | None = None,
    _index_scan=None,
) -> Iterator[list[tuple[str, bytes | memoryview, int]]]:
    """Like :func:`iter_tar`, but yields the members in lists (one list per buffer's worth).

    This is the reader's hot path. Plain ustar members that lie wholly inside the current buffer
    are parsed in a tight loop and their header checksums verified together (vectorised) before
    any of them is handed out; everything else (extended headers, links, members that span
    buffers, the end of the archive) goes through the general path one header at a time.
    With ``accelerate`` (default) the fast loop runs in C when the extension is built.
    ``offset`` is where the input starts in the tar stream (a reader that seeked there): the
    members' offsets are counted from it.

    A :class:`~tarshards.tario.buffer.MappedFile` (a local plain file, see
    :func:`tar_byte_source`) is parsed in place, in windows of ``chunk_size`` bytes of headers;
    with ``copy=False`` its members are ``memoryview`` slices of the map (see :func:`iter_tar`).
    A stream is read ``chunk_size`` bytes at a time (a reader among many passes a small one).

    ``_layout`` (the indexer's): a list to which the general path appends, for each member it
    yields, ``(offset, data offset, stored size, rebuilt)`` (``rebuilt``: a sparse member, whose
    stored bytes are a map and runs), and so does the C scan for a member behind a pax header; a
    member of a fast-path batch that is not listed is one ustar header followed by its data.
    ``_index_scan(buf, pos, base, end) -> pos`` (the indexer's C loop,
    :meth:`tarshards.format.index.IndexBuilder.scan`) takes runs of plain members out of the buffer
    before the fast path would (recording them, not yielding them).
    """
    b = reader_buffer(chunks, offset, chunk_size)
    try:
        yield from _batches(b, source, verify, drain, accelerate, copy, _layout, _index_scan)
    finally:
        b.close()


def _batches(
    b: _Buffer,
    source,
    verify: bool,
    drain: bool,
    accelerate: bool,
    copy: bool,
    layout=None,
    index_scan=None,
):
    long_name = None  # a GNU long name for the member being assembled
    warned_link = False  # a link that a sample misses was named (once a shard)
    long_first = False  # the long name came before the member's pax header (it wins)
    pax: dict | None = None  # the pax keys for the member being assembled (globals included)
    own: set = set()  # the keys its own pax headers set (while pax is not None)
    pax_first: dict = {}  # pax less the global headers read after the member's first pax header
    global_pax: dict = {}
    global_read = False  # the global keys change how members are read: no fast path
    start = None  # offset of the first header of the member being assembled
    last = None  # the member read or skipped last (for the error when the stream is cut after it)
    fill = b.fill
    buf = b.buf
    pos = b.pos
    end = b.end
    base = b.base
    mapped = b.mapped  # the whole file is in buf: scan it in windows of headers
    # a local file read with pread: the C scan reads members the buffer cuts into their bytes
    direct = b.file if isinstance(b, _DirectBuffer) and accelerate and _SCAN_DIRECT else None
    # zero-copy: members of a mapped file are slices of one read-only view of the map
    view = None if copy or not mapped else memoryview(buf)
    # a batch of copies is kept small, so that its bytes go where the last batch's were
    window = b.size if view is not None else min(b.size, COPY_WINDOW)
    regular = _REGULAR
    zero = _ZERO_BLOCK
    scan = _scan_members if accelerate else None
    # members behind harmless pax headers (tarfile's and webdataset's float mtime on every
    # member) are read by the C scan too; it reports where their data lies in layout
    while True:
        if start is None and not global_read and end - pos >= BLOCK:
            if mapped:
                b.release(pos)
                limit = pos + window
            else:
                limit = end
            if index_scan is not None:  # the indexer records plain runs itself, in C
                taken = index_scan(buf, pos, base, min(end, limit))
                if taken != pos:
                    pos = taken
                    last = None
                    continue
            if scan is not None:
                # stops where the general path decides, or at the first header after limit
                if direct is None:
                    batch, pos = scan(buf, pos, base, end, limit, view, True, layout)
                else:  # a member the buffer cuts is read from the file into its bytes, the
                    # buffer refilled from the next header on (the scan goes on from there)
                    batch, pos, end, new_base, direct.pos, taken = scan(
                        buf, pos, base, end, limit, None, True, layout, *direct.state()
                    )
                    base = b.base = new_base + taken
                    b.end = end
                if batch:
                    last = _last_of(batch)
                    yield batch
                    batch = None  # the consumer's to free before the next batch is copied
                    if pos >= limit or direct is not None:
                        continue
            else:  # the same fast path in Python: plain members wholly inside the buffer
                batch = []
                headers = []
                while end - pos >= BLOCK and pos < limit:
                    hdr = buf[pos : pos + BLOCK]
                    if hdr[156] != 0x30 or hdr[135] or hdr[345]:
                        break  # not a plain regular member with a canonical size field
                    try:
                        size = parse_octal(hdr[124:135].lstrip(b" "))
                    except ValueError:
                        break
                    if size < 0 or end - pos - BLOCK < size:
                        break
                    nul = hdr.find(0, 0, 100)
                    name = (hdr[:nul] if nul >= 0 else hdr[:100]).decode("utf-8", "surrogateescape")
                    data = (
                        bytes(buf[pos + BLOCK : pos + BLOCK + size])
                        if view is None
                        else view[pos + BLOCK : pos + BLOCK + size]
                    )
                    batch.append((name, data, base + pos))
                    headers.append(hdr)
                    pos += BLOCK + ((size + 511) & ~511)
                if batch:
                    bad = _first_bad_header(headers) if verify else -1
                    if bad >= 0:
                        if bad:
                            yield batch[:bad]
                        raise _bad_header(headers[bad], source, batch[bad][2], b.origin)
                    last = _last_of(batch)
                    yield batch
                    batch, headers = [], []
                    continue
        if end - pos < BLOCK:
            b.pos = pos
            try:
                more = fill(BLOCK)
            except (CompressionError, TruncatedShardError) as exn:  # cut in or before a header
                raise exn.with_context(member=_partial_name(b)) from None
            if not more:
                _at_eof(b, source, start, long_name, pax, last)  # raises unless a clean end
                return
            pos = b.pos
            end = b.end
            base = b.base
        hdr = bytes(buf[pos : pos + BLOCK])
        if hdr == zero:
            if start is not None:
                raise HeaderError(
                    "an extended header is followed by the end-of-archive marker "
                    "instead of its member",
                    url=source,
                    member=_pending_name(long_name, pax),
                    offset=start,
                )
            b.pos = pos + BLOCK
            if _archive_ends(b, source, drain):
                return
            pos = b.pos
            end = b.end
            base = b.base
            continue
        if verify and _header_sum(hdr) != _chk_value(hdr) and not checksum_ok(hdr):
            raise _bad_header(hdr, source, base + pos, b.origin)
        try:
            size = size_number(hdr)
        except ValueError:
            size = _size_field(hdr, source, base + pos)
        if size < 0:
            size = _size_field(hdr, source, base + pos)
        typeflag = hdr[156]
        fresh = start is None  # this header starts a member (no extended header before it)
        first: int = base + pos if start is None else start  # the member's first header
        start = first
        pos += BLOCK
        meta = pax if pax is not None else (global_pax if global_read else None)
        if meta is not None and "size" in meta and typeflag not in _META:
            size = _pax_size(meta, source, start)  # (not for the extended headers themselves)
        padded = (size + 511) & ~511
        if typeflag in regular or typeflag == _GNU_SPARSE:
            name = _member_name(
                hdr, long_name if long_first or meta is None or "path" not in meta else None, meta
            )
            if not typeflag and name[-1:] == "/":  # pre-POSIX directory (typeflag NUL)
                last = (name, start, base + pos + size)
                pos += padded
                long_name = pax = start = None
                long_first = False
                continue
            pax_sparse = meta is not None and not _SPARSE_KEYS.isdisjoint(meta)
            if typeflag == _GNU_SPARSE:
                if pax_sparse:
                    raise HeaderError(
                        "an old-GNU sparse member with pax GNU.sparse records "
                        "(contradictory sparse maps)",
                        url=source,
                        member=name,
                        offset=start,
                    )
                b.pos = pos
                chunks_map, realsize = _old_gnu_sparse_map(hdr, b, source, name, start)
                pos = b.pos
                end = b.end
                base = b.base
            sparse = pax_sparse or typeflag == _GNU_SPARSE  # rebuilt below (bytes)
            data_at = base + pos
            data, pos = _take(b, pos, size, padded, source, name, start, None if sparse else view)
            end = b.end
            base = b.base
            if typeflag == _GNU_SPARSE:
                data = _unsparse(data, chunks_map, realsize, source, name, start)
            elif pax_sparse and meta is not None:
                data = _pax_unsparse(data, meta, source, name, start)
            last = (name, start, None)
            if layout is not None:  # (a pax global size= sets this member's size: "global")
                glob = pax is None and meta is not None and "size" in meta
                layout.append((first, data_at, size, sparse or ("global" if glob else False)))
            yield [(name, data, first)]
            long_name = pax = start = None
            long_first = False
            continue
        # metadata and non-regular members
        if typeflag in _META:
            if size > _MAX_META:
                raise HeaderError("implausibly large extended header", url=source, offset=start)
            # a GNU long name is read to its NUL within its blocks, past its declared size where
            # it runs on (as GNU tar and tarfile read it)
            want = padded if typeflag == _GNU_LONGNAME else size
            payload, pos = _take(b, pos, want, padded, source, None, start)
            end = b.end
            base = b.base
            if typeflag == _GNU_LONGNAME:
                if long_name is None:  # the first of several long names wins (as in tarfile)
                    long_name = _nts(payload).decode("utf-8", "surrogateescape")
                    long_first = pax is None or "path" not in pax_first  # the outer name wins
            elif typeflag == _PAX:
                records = _parse_pax(payload, source, start)
                if pax is None:
                    pax = pax_first = _merge_pax(global_pax, records)
                    own = set(records)
                else:  # a second pax header for one member: the first one's keys win
                    own |= set(records)
                    if not (_SPARSE_KEYS.isdisjoint(pax_first) or _SPARSE_KEYS.isdisjoint(records)):
                        raise HeaderError(
                            "two pax headers with GNU.sparse records for one "
                            "member (contradictory sparse maps)",
                            url=source,
                            member=_pending_name(long_name, pax),
                            offset=start,
                        )
                    pax = _merge_pax(pax, records, pax_first)
                    pax_first = _merge_pax(pax_first, records, pax_first)
            elif typeflag == _PAX_GLOBAL:
                records = _parse_pax(payload, source, start)
                if not _SPARSE_KEYS.isdisjoint(records):
                    raise HeaderError(
                        "GNU.sparse records in a pax global header (a sparse map "
                        "belongs to one member)",
                        url=source,
                        offset=start,
                    )
                global_pax = _merge_pax(global_pax, records)
                global_read = not _PAX_READ_KEYS.isdisjoint(global_pax)
                if pax is not None:
                    # between a member's pax header and the member: its keys apply to the member
                    # too, under the member's own (as GNU tar applies them)
                    pax = _merge_pax(pax, {k: v for k, v in records.items() if k not in own})
                if fresh:  # a global header is no member's first header
                    last = (None, start, None)
                    start = None
            continue  # long link names are irrelevant: links are skipped
        # directories, links, devices, fifos: no data; other types: skip their data
        if typeflag not in _NO_DATA:
            last = (_member_name(hdr, long_name, meta), start, base + pos + size)
            pos += padded
        elif typeflag in _LINKS and not warned_link:
            warned_link = _warn_link(hdr, typeflag, long_name, meta, source, start)
        long_name = pax = start = None
        long_first = False


_LINKS = (0x31, 0x32)  # '1' hard link, '2' symbolic link


def _warn_link(hdr: bytes, typeflag: int, long_name, meta, source, start: int) -> bool:
    """A link whose name is a sample's member (``KEY.EXT``) is skipped like every member that is
    not a regular file, but its sample then lacks that field: say so, once a shard (True when
    said). GNU tar writes a file with several hard links once, and the others as links to it."""
    name = _member_name(hdr, long_name, meta)
    base = name.rsplit("/", 1)[-1]
    dot = base.find(".")
    if base.startswith("__") or dot <= 0 or dot == len(base) - 1:
        return False  # no field of a sample (the grouping's rule): nothing is lost
    target = meta.get("linkpath") if meta is not None else None
    if not target:
        nul = hdr.find(0, 157, 257)
        target = hdr[157 : nul if nul >= 0 else 257].decode("utf-8", "surrogateescape")
    if typeflag == 0x31:
        what = (
            "a hard link: its data is stored once, under the member it links to; make the "
            "shard with tar --hard-dereference to store it under this name too"
        )
    else:
        what = "a symbolic link: make the shard with tar --dereference (-h) to store the data"
    warnings.warn(
        TarshardsWarning(
            f"{source or 'a tar stream'}: member {name!r} at offset {start} links to "
            f"{target!r} and is skipped (only regular files are read), so its sample has no "
            f"such field. It is {what}. Further links in this shard are skipped without a "
            "warning"
        ),
        stacklevel=5,
    )
    return True


def _last_of(batch: list) -> tuple:
    """What the end-of-stream error needs of a batch's last member (name, offset), without
    its data: a batch kept for it would stay alive while the next is read."""
    name, _, offset = batch[-1]
    return (name, offset, None)


def _take(
    b: _Buffer, pos: int, size: int, padded: int, source, name, start, view=None
) -> tuple[bytes, int]:
    """The ``size`` data bytes at ``pos`` and the position after their padding (read into the
    buffer first when they are not all there yet). With ``view`` (a memoryview of a mapped
    buffer) they are a slice of it, not a copy."""
    if b.end - pos >= size:
        if view is not None:
            return view[pos : pos + size], pos + padded
        return bytes(b.buf[pos : pos + size]), pos + padded
    b.pos = pos
    try:
        data = _read_data(b, size, padded, source, name, start)
    except (CompressionError, TruncatedShardError) as exn:  # cut inside this member's data
        raise exn.with_context(member=name) from None
    return data, b.pos


def _archive_ends(b: _Buffer, source, drain: bool) -> bool:
    """``b.pos`` is just past a zero block: True if the archive ends here (a second zero block or
    the end of the stream), False for a lone zero block followed by more headers (a warning)."""
    at = b.offset() - BLOCK
    if not b.fill(BLOCK):
        if bytes(b.buf[b.pos : b.end]).strip(b"\0"):
            raise TruncatedShardError(
                "truncated tar stream: a zero block, then an incomplete header block",
                url=source,
                offset=at + BLOCK,
            )
        return True
    if b.buf[b.pos : b.pos + BLOCK] == _ZERO_BLOCK:
        b.pos += BLOCK
        if drain:
            b.drain(_DRAIN_LIMIT)
        return True
    warnings.warn(
        TarshardsWarning(
            f"a lone zero block at offset {at} of {source or 'a tar stream'}, and more headers "
            f"after it: reading on (as tar --ignore-zeros does)"
        ),
        stacklevel=4,
    )
    return False


def _at_eof(b: _Buffer, source, start, long_name, pax, last) -> None:
    """The stream ended where a header should start: raise unless that is a clean end."""
    if start is not None or b.end > b.pos:
        _eof_in_header(b, source, start, long_name, pax)
    if b.pos > b.end:  # the stream ends inside the data or padding of the last member
        name, offset, data_end = last
        stream_end = b.base + b.end
        if data_end is None or stream_end >= data_end:
            whole = True
            where = "inside the zero padding after the data of the last member"
        else:
            whole = False
            where = f"{data_end - stream_end} bytes short of the end of a skipped member's data"
        exn = TruncatedShardError(
            f"truncated tar stream: it ends {where} (after {stream_end} bytes, without the "
            "end-of-archive marker)",
            url=source,
            member=name,
            offset=offset,
        )
        exn.member_whole = whole and name is not None
        raise exn
    if b.offset() == b.origin == 0:  # (read on from an offset: the end of a tar without
        # its end-of-archive marker, which the reader accepts as tar does)
        raise TruncatedShardError("empty shard: 0 bytes, not a tar archive", url=source, offset=0)


def _eof_in_header(b: _Buffer, source, start, long_name, pax) -> None:
    """Raise the error for a stream that ends inside a header (or after extended headers)."""
    left = max(0, b.end - b.pos)
    offset = b.offset() if start is None else start
    if offset == b.origin and left:
        raise TruncatedShardError(
            f"not a tar archive: the stream holds only {left} bytes, less than one "
            f"{BLOCK}-byte tar header",
            url=source,
            offset=0,
        )
    what = "incomplete header block" if left else "extended header without its member"
    member = _pending_name(long_name, pax)
    if member is None and start is None:
        member = _partial_name(b)
    raise TruncatedShardError(
        f"truncated tar stream: {what}", url=source, member=member, offset=offset
    )


def _partial_name(b: _Buffer) -> str | None:
    """The member name in the incomplete header block at ``b.pos`` when it can be read whole:
    its name field, and its ustar prefix field (or the absence of the ustar magic)."""
    part = bytes(b.buf[b.pos : min(b.end, b.pos + BLOCK)])
    if len(part) < 263:  # the magic that says whether a prefix field exists is missing
        return None
    prefix = b""
    if part[257:262] == b"ustar":
        if len(part) < 500:
            return None
        prefix = _nts(part[345:500])
    try:
        name = _nts(part[:100]).decode("utf-8")
        if prefix:
            name = prefix.decode("utf-8") + "/" + name
    except UnicodeDecodeError:
        return None
    return name if name and name.isprintable() else None


def open_tar_bytes(stream: BinaryIO, source=None, chunk_size: int = CHUNK_SIZE):
    """Members ``(name, data, offset)`` of a possibly compressed tar byte stream."""
    return iter_tar(tar_byte_source(stream, source, chunk_size), source)
