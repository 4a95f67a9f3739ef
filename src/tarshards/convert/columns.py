"""From columns to tar members: which extension each column of a table becomes, and its bytes.

One set of rules for every tabular source (Parquet, Hugging Face datasets, JSONL):

* binary columns, and structs holding ``bytes`` (how Hugging Face stores ``Image`` and ``Audio``
  features, in its datasets and in its Parquet files) are media: their bytes are written as they
  are. The extension is the column's name when that is an extension (``jpg``, ``seg.png``...),
  else the format of the data (the path's suffix where a struct has one, else the content's
  signature: ``jpg``, ``png``, ``wav``, ``flac``, ``mp4``, ``npy``...), or ``COLUMN.FORMAT``
  when two columns would get the same one;
* class labels (Hugging Face ``ClassLabel``, or an integer column named ``label``, ``labels``,
  ``class``, ``target`` or ``cls``) become ``cls`` (the number as text);
* other scalars become text: the name as extension where it is one (``txt``, ``json``, ``cls``),
  else ``COLUMN.txt``;
* lists, structs and maps become JSON (``json``, or ``COLUMN.json``).

The plan is made once, before any shard is written, from the schema and the first rows, so every
shard names its members the same way; ``extensions={column: ext}`` overrides it column by column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = [
    "Column",
    "KNOWN_EXTENSIONS",
    "LABEL_NAMES",
    "format_of",
    "plan_columns",
    "row_key",
    "value_bytes",
]

# extensions a column name is taken as (the readers' decoders know them)
MEDIA_EXTENSIONS = frozenset(
    "jpg jpeg png gif webp bmp tif tiff ppm pgm pbm pnm wav flac mp3 ogg opus m4a aac mp4 webm "
    "mkv avi mov npy npz bin pdf zip".split()
)
TEXT_EXTENSIONS = frozenset(["txt", "text", "transcript"])
JSON_EXTENSIONS = frozenset(["json", "jsn"])
CLS_EXTENSIONS = frozenset(["cls", "cls2"])
KNOWN_EXTENSIONS = MEDIA_EXTENSIONS | TEXT_EXTENSIONS | JSON_EXTENSIONS | CLS_EXTENSIONS
LABEL_NAMES = frozenset(["label", "labels", "class", "target", "cls"])

# how a column's values become bytes
BYTES, MEDIA, TEXT, SCALAR, JSON = "bytes", "media", "text", "scalar", "json"


@dataclass(frozen=True)
class Column:
    """One column's member: ``name`` in the table, ``ext`` in the tar, ``how`` its values are
    made bytes (``bytes``: as they are; ``media``: a struct's ``bytes``, or the file at its
    ``path``; ``text``: UTF-8; ``scalar``: the value as text; ``json``: JSON)."""

    name: str
    ext: str
    how: str


_SIGNATURES: list[tuple[int, bytes, str]] = [
    (0, b"\xff\xd8\xff", "jpg"),
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"GIF8", "gif"),
    (0, b"BM", "bmp"),
    (0, b"II*\x00", "tiff"),
    (0, b"MM\x00*", "tiff"),
    (0, b"fLaC", "flac"),
    (0, b"OggS", "ogg"),
    (0, b"ID3", "mp3"),
    (0, b"\x1a\x45\xdf\xa3", "webm"),
    (0, b"\x93NUMPY", "npy"),
    (0, b"%PDF", "pdf"),
    (0, b"PK\x03\x04", "zip"),
    (4, b"ftyp", "mp4"),
]


def format_of(data: bytes | None, path: str | None = None) -> str | None:
    """The extension that names ``data``'s format: the suffix of ``path`` where it has one,
    else from the content's signature (None: not known)."""
    if path:
        base = path.rsplit("/", 1)[-1]
        if "." in base:
            suffix = base.rsplit(".", 1)[1].lower()
            if suffix:
                return "jpg" if suffix == "jpeg" else suffix
    if not data:
        return None
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and len(head) >= 12:
        return {b"WEBP": "webp", b"WAVE": "wav", b"AVI ": "avi"}.get(head[8:12])
    if head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "mp3"
    for offset, magic, ext in _SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return ext
    return None


def _is_extension_name(name: str) -> bool:
    return name.lower() in KNOWN_EXTENSIONS or ("." in name and not name.startswith("."))


def _check_ext(ext: str, column: str) -> str:
    if not isinstance(ext, str) or not ext or "/" in ext or ext.startswith("__"):
        raise ValueError(f"column {column!r}: {ext!r} is not a valid member extension")
    return ext


def plan_columns(
    kinds: dict[str, str],
    samples: dict[str, list],
    *,
    extensions: dict[str, str] | None = None,
    labels: frozenset | set = frozenset(),
) -> list[Column]:
    """The member plan of a table: ``kinds`` maps each column (in order) to ``binary``,
    ``media`` (a struct with ``bytes``/``path``), ``string``, ``int``, ``scalar`` (other
    numbers, booleans, dates) or ``nested``; ``samples`` holds a few of its values (to tell the
    format of media); ``labels`` names the columns that are class labels."""
    extensions = dict(extensions or {})
    unknown = set(extensions) - set(kinds)
    if unknown:
        raise ValueError(
            f"extensions= names columns the source does not have: {', '.join(sorted(unknown))} "
            f"(it has: {', '.join(kinds)})"
        )
    chosen: list[list] = []  # [name, how, ext or None, fallback (format)]
    for name, kind in kinds.items():
        given = extensions.get(name)
        if kind in ("binary", "media"):
            how = BYTES if kind == "binary" else MEDIA
            fmt = None
            for v in samples.get(name, ()):
                if v is None:
                    continue
                data, path = (v, None) if kind == "binary" else (v.get("bytes"), v.get("path"))
                fmt = format_of(data, path)
                if fmt is not None:
                    break
            if given is None and _is_extension_name(name):
                given = name.lower() if "." not in name else name
            chosen.append([name, how, given, fmt or "bin"])
        elif name in labels or (kind == "int" and name.lower() in LABEL_NAMES):
            chosen.append([name, SCALAR, given, "cls"])
        elif kind == "nested":
            if given is None and name.lower() in JSON_EXTENSIONS:
                given = name.lower()
            chosen.append([name, JSON, given, None])
        else:
            how = TEXT if kind == "string" else SCALAR
            lowered = name.lower()
            if given is None and (
                lowered in TEXT_EXTENSIONS
                or lowered in JSON_EXTENSIONS
                or (lowered in CLS_EXTENSIONS and kind == "int")
                or ("." in name and not name.startswith("."))
            ):
                given = name if "." in name else lowered
            chosen.append([name, how, given, None])
    taken = {c[2] for c in chosen if c[2] is not None}
    # formats (jpg, cls) go to the first column that has them, if no column took them by name
    for c in chosen:
        if c[2] is None and c[3] is not None and c[3] not in taken:
            c[2] = c[3]
            taken.add(c[3])
    for c in chosen:
        if c[2] is None:
            suffix = c[3] if c[3] is not None else ("json" if c[1] == JSON else "txt")
            c[2] = f"{c[0]}.{suffix}"
    plan = [Column(name, _check_ext(ext, name), how) for name, how, ext, _ in chosen]
    seen: dict[str, str] = {}
    for col in plan:
        if col.ext in seen:
            raise ValueError(
                f"columns {seen[col.ext]!r} and {col.name!r} would both become .{col.ext} "
                "members; choose their extensions with extensions={column: ext}"
            )
        seen[col.ext] = col.name
    return plan


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("binary values inside a nested column cannot be written as JSON")
    return str(value)  # dates, decimals...


def value_bytes(col: Column, value, read_file=None) -> bytes | None:
    """The member bytes of one value of ``col`` (None: no member for this sample).
    ``read_file(path)`` gives a media struct's bytes where it holds only a path."""
    if value is None:
        return None
    how = col.how
    if how == BYTES:
        return bytes(value)
    if how == TEXT:
        return value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if how == SCALAR:
        if isinstance(value, bool):
            return b"true" if value else b"false"
        return str(value).encode("utf-8")
    if how == MEDIA:
        data = value.get("bytes")
        if data is None:
            path = value.get("path")
            if not path or read_file is None:
                return None
            return read_file(path)
        return bytes(data)
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default).encode("utf-8")
    except TypeError as exc:
        raise ValueError(
            f"column {col.name!r}: {exc}; give it an extension with extensions= to write it "
            "as it is, or leave it out"
        ) from None


def row_key(value, row: int) -> str:
    """A sample key from a key column's value, checked as the tar writer would."""
    if value is None:
        raise ValueError(f"row {row}: the key column is empty")
    key = value if isinstance(value, str) else str(value)
    base = key.rpartition("/")[2]
    if not base or "." in base or base.startswith("__"):
        raise ValueError(
            f"row {row}: {key!r} cannot be a sample key (its base name is empty, holds a dot, "
            "or starts with '__'); choose another key column, or none (keys from row numbers)"
        )
    return key
