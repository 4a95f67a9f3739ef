"""GNU sparse members: the stored chunks and a map of where they go; holes are zeros.

Old GNU ('S' members, maps in the header and its extension blocks) and pax formats 0.0, 0.1 and
1.0, rebuilt in memory up to ``_MAX_SPARSE`` bytes.
"""

from __future__ import annotations

from ..errors import HeaderError
from .buffer import _Buffer, _read_data
from .headers import _MAX_SPARSE, BLOCK, _decimal, parse_number


def _sparse_entries(block: bytes, first: int, count: int, source, name, start) -> list:
    out = []
    for i in range(count):
        at = first + 24 * i
        try:
            offset = parse_number(block[at : at + 12])
            numbytes = parse_number(block[at + 12 : at + 24])
        except ValueError:
            raise HeaderError(
                "bad GNU sparse map entry", url=source, member=name, offset=start
            ) from None
        out.append((offset, numbytes))
    return out


def _old_gnu_sparse_map(hdr: bytes, b: _Buffer, source, name, start):
    """The map of an old-GNU sparse member ('S'): four entries in the header, 21 in each
    extension block that follows it (``b.pos`` moves past those)."""
    chunks = _sparse_entries(hdr, 386, 4, source, name, start)
    try:
        realsize = parse_number(hdr[483:495])
    except ValueError:
        raise HeaderError(
            "bad GNU sparse real size", url=source, member=name, offset=start
        ) from None
    extended = hdr[482]
    while extended:
        block = _read_data(b, BLOCK, BLOCK, source, name, start)
        chunks.extend(_sparse_entries(block, 0, 21, source, name, start))
        extended = block[504]
    return chunks, realsize


def _pax_unsparse(data: bytes, meta: dict, source, name, start) -> bytes:
    """Rebuild a pax GNU sparse member (formats 0.0, 0.1 and 1.0)."""
    if "GNU.sparse.map" in meta:  # 0.1: "offset,size,offset,size..."
        fields = meta["GNU.sparse.map"].split(",") if meta["GNU.sparse.map"] else []
        nums = [_decimal(f, "GNU sparse map", source, start, name) for f in fields]
        if len(nums) % 2:
            raise HeaderError(
                "GNU sparse map with an odd count", url=source, member=name, offset=start
            )
        realsize = _decimal(meta.get("GNU.sparse.size"), "GNU.sparse.size", source, start, name)
        chunks = list(zip(nums[::2], nums[1::2]))
    elif "GNU.sparse.size" in meta:  # 0.0: repeated offset/numbytes records
        offsets = meta.get("GNU.sparse.offset", [])
        sizes = meta.get("GNU.sparse.numbytes", [])
        if (
            not isinstance(offsets, list)
            or not isinstance(sizes, list)
            or len(offsets) != len(sizes)
        ):
            raise HeaderError(
                "GNU sparse 0.0 map: offsets and sizes do not pair up",
                url=source,
                member=name,
                offset=start,
            )
        realsize = _decimal(meta["GNU.sparse.size"], "GNU.sparse.size", source, start, name)
        chunks = [
            (
                _decimal(o, "GNU sparse offset", source, start, name),
                _decimal(n, "GNU sparse size", source, start, name),
            )
            for o, n in zip(offsets, sizes)
        ]
    elif meta.get("GNU.sparse.major") == "1" and meta.get("GNU.sparse.minor") == "0":
        realsize = _decimal(
            meta.get("GNU.sparse.realsize"), "GNU.sparse.realsize", source, start, name
        )
        chunks, skip = _sparse10_map(data, source, name, start)
        data = data[skip:]
    else:
        raise HeaderError(
            f"unsupported GNU sparse format {meta.get('GNU.sparse.major')}."
            f"{meta.get('GNU.sparse.minor')}",
            url=source,
            member=name,
            offset=start,
        )
    return _unsparse(data, chunks, realsize, source, name, start)


def _sparse10_map(data: bytes, source, name, start):
    """The map at the start of a pax 1.0 sparse member's data: a count, then offset/size pairs,
    one decimal number a line, padded to a block. Returns the pairs and the map's length."""
    nums: list[int] = []
    count = -1
    pos = 0
    while count < 0 or len(nums) < 2 * count:
        nl = data.find(b"\n", pos, pos + 21)
        field = data[pos:nl]
        if nl < 0 or not field.isdigit():
            raise HeaderError("bad GNU sparse 1.0 map", url=source, member=name, offset=start)
        if count < 0:
            count = int(field)
            if 4 * count > len(data):
                raise HeaderError(
                    "GNU sparse 1.0 map longer than the member",
                    url=source,
                    member=name,
                    offset=start,
                )
        else:
            nums.append(int(field))
        pos = nl + 1
    return list(zip(nums[::2], nums[1::2])), (pos + 511) & ~511


def _unsparse(data: bytes, chunks: list, realsize: int, source, name, start) -> bytes:
    """Place the stored ``data`` chunks at their offsets in ``realsize`` zero bytes."""
    if realsize > _MAX_SPARSE:
        raise HeaderError(
            f"sparse member of {realsize} bytes: more than the {_MAX_SPARSE} this "
            "reader rebuilds in memory",
            url=source,
            member=name,
            offset=start,
        )
    out = bytearray(realsize)
    done = 0  # end of the last chunk in the file
    taken = 0  # stored bytes used
    for offset, numbytes in chunks:
        if not numbytes:
            continue
        if offset < done or offset + numbytes > realsize or taken + numbytes > len(data):
            raise HeaderError(
                "inconsistent GNU sparse map (chunks out of order, beyond the "
                "file or the stored data)",
                url=source,
                member=name,
                offset=start,
            )
        out[offset : offset + numbytes] = data[taken : taken + numbytes]
        taken += numbytes
        done = offset + numbytes
    return bytes(out)
