"""What ``tarshards convert`` reads: each kind of source as a numbered list of rows.

A source lists its rows once, in a fixed order (sorted paths, file order, dataset order), so that
row ``i`` is the same row on every run; shard ``k`` of a conversion gets a fixed range of rows
(:mod:`tarshards.convert.shards`). Every source has:

* ``count()``: the number of rows; ``sizes()``: each row's size in bytes (an estimate for tables;
  for folders measured only when asked, as a ``stat`` per file costs as much as listing them);
* ``identity()``: what the conversion's fingerprint covers (names and sizes, schema, options);
* ``info()``: what goes into the manifest's ``info`` (the class names of an ImageFolder);
* ``samples(start, stop)``: ``(key, [(ext, bytes), ...])`` for the rows in ``range(start, stop)``.

Sources are pickled to the worker processes (or Dask workers) that write the shards; what they
open there (a Parquet file, a dataset) is opened there.
"""

from __future__ import annotations

import array
import contextlib
import gc
import itertools
import json
import os
from typing import Iterator

from ..errors import MissingDependencyError
from .columns import Column, plan_columns, row_key, value_bytes

__all__ = [
    "IMAGE_EXTENSIONS",
    "KINDS",
    "FolderSource",
    "HFSource",
    "JsonlSource",
    "ParquetSource",
    "Source",
    "detect_kind",
    "open_source",
    "read_file",
    "require_pyarrow",
]

KINDS = ("imagefolder", "files", "parquet", "hf", "jsonl")
# the image files of an ImageFolder (torchvision's IMG_EXTENSIONS, and webp/avif)
IMAGE_EXTENSIONS = frozenset("jpg jpeg png ppm bmp pgm tif tiff webp gif avif".split())
_INFER_ROWS = 100  # rows read to tell media formats and JSONL field kinds

Sample = tuple[str, list[tuple[str, bytes]]]


def require_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise MissingDependencyError(
            "converting Parquet needs pyarrow: pip install 'tarshards[convert]'"
        ) from None
    return pyarrow


def _datasets():
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError(
            "converting Hugging Face datasets needs the datasets package: "
            "pip install 'tarshards[convert]'"
        ) from None
    return datasets


class Source:
    """The rows of a source (see the module docstring)."""

    kind = "?"

    def count(self) -> int:
        raise NotImplementedError

    def sizes(self) -> list[int] | None:
        """Each row's size in bytes (None: not measured; shards are then cut by count)."""
        raise NotImplementedError

    def identity(self) -> dict:
        raise NotImplementedError

    def info(self) -> dict:
        return {}

    def samples(self, start: int, stop: int) -> Iterator[Sample]:
        raise NotImplementedError


_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
# a folder opened for openat() (FolderSource.samples); None where os.open takes no dir_fd
_O_DIR = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    if os.open in os.supports_dir_fd
    else None
)
_FIRST_READ = 1 << 16


def read_file(path: str, dir_fd: int | None = None) -> bytes:
    """A whole file's bytes: ``open``, one ``read`` for a small file (a short read of a regular
    file is its end), ``close``. Measured: 1.6-2x faster than ``open(path, "rb").read()``
    on 4 KB files (which also asks the size and reads once more to see the end). ``dir_fd``: a
    descriptor of the folder that ``path`` is relative to (``openat``)."""
    fd = os.open(path, _O_READ, dir_fd=dir_fd)
    try:
        data = os.read(fd, _FIRST_READ)
        if len(data) < _FIRST_READ:
            return data
        parts = [data]
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _gc_paused():
    """The cyclic garbage collector paused (listing and unpickling make many small tuples and
    no cycles; its passes over the heap cost a third of a 20,000-file listing)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _row_keys(n: int) -> int:
    """The width of row-number keys (``000042``) for ``n`` rows."""
    return max(6, len(str(max(n - 1, 0))))


# ---------------------------------------------------------------------------------------------
# folders: an ImageFolder tree, or files grouped by base name
# ---------------------------------------------------------------------------------------------


class FolderSource(Source):
    """Files under ``root`` grouped into samples.

    ``imagefolder``: each sub-folder of ``root`` is a class (sorted names, numbered from 0, as
    torchvision's ``ImageFolder`` does); the files under it (at any depth) are grouped by name
    without its last suffix (``a.jpg`` and ``a.json`` are one sample; dots left in the name become
    ``_``), groups without an image are left out, and each sample gets ``cls``. Keys are
    ``CLASS/NAME``. ``files``: files at any depth grouped by the part of the name before its
    first dot, as tar readers group members (``a.jpg``, ``a.json``, ``a.seg.png``); keys are the
    relative paths without extensions. Hidden files and folders are left out.

    ``sizes=True`` measures each file (a ``stat``): for shards cut by size, and for a plan that
    also notices a file changed in size.

    The listing is a folder at a time (one ``scandir``, the names sorted and split in one
    pass, the garbage collector paused) and kept in columns (a tuple per row made the
    collector's next pass over them cost 4-10 ms); the columns pickle as a few strings (a
    worker process gets them in a millisecond, not the 20 ms that 20,000 tuples took), and
    files are opened relative to their folder (``openat``: the kernel walks one name, not the
    whole path).
    """

    def __init__(self, root, kind: str = "files", *, fields=None, sizes: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"no such folder: {self.root}")
        if kind not in ("imagefolder", "files"):
            raise ValueError(f"a folder source is 'imagefolder' or 'files', not {kind!r}")
        self.kind = kind
        self.measured = sizes
        self.fields = None if fields is None else frozenset(fields)
        self.classes: list[str] = []
        self.left_out = 0  # ImageFolder groups without an image
        # the rows, in columns: key; the extension of its one file (None: several files); the
        # file's relative path (several: ((ext, relative path), ...)); class or -1; bytes
        self._keys: list[str] = []
        self._exts: list[str | None] = []
        self._paths: list = []
        self._classes: list[int] = []
        self._sizes: list[int] = []
        with _gc_paused():
            if kind == "imagefolder":
                self._list_imagefolder()
            else:
                self._list_files()

    def _folders(self, top: str, rel: str = ""):
        """``(relative dir, names, sizes)`` of each folder under ``top`` with visible files: the
        files in name order (sizes 0 unmeasured), then each sub-folder's, in name order (one
        ``scandir`` per folder; symbolic links to folders followed, as
        ``os.walk(followlinks=True)``)."""
        with os.scandir(top) as it:
            entries = [e for e in it if e.name[0] != "."]
        subdirs = sorted((e.name, e.path) for e in entries if e.is_dir())
        if subdirs:
            entries = [e for e in entries if not e.is_dir()]
        if self.measured:
            stats = sorted([(e.name, e.stat().st_size) for e in entries])
            names = [n for n, _ in stats]
            sizes = [z for _, z in stats]
        else:
            names = sorted([e.name for e in entries])
            sizes = [0] * len(names)
        if names:
            yield rel, names, sizes
        for name, path in subdirs:
            yield from self._folders(path, f"{rel}/{name}" if rel else name)

    def _add_rows(
        self, keys: list, exts: list, paths: list, sizes: list, cls: int, need_image: bool
    ) -> None:
        """Rows from the files ``paths`` (relative) and what they are (``keys``, ``exts``,
        ``sizes``): the files of a key are one sample (sorted by extension), the samples in key
        order; with ``need_image``, samples without an image are left out."""
        fields = self.fields
        if fields is not None:
            keep = [i for i, e in enumerate(exts) if e in fields]
            keys, exts, paths, sizes = (
                [keys[i] for i in keep],
                [exts[i] for i in keep],
                [paths[i] for i in keep],
                [sizes[i] for i in keep],
            )
        if len(set(keys)) == len(keys):  # a file a sample (the usual case): no grouping
            images = IMAGE_EXTENSIONS
            if keys == sorted(keys) and (
                not need_image or all([e in images for e in exts])
            ):  # (the names' order is the keys' order, and every file is an image)
                self._keys += keys
                self._exts += exts
                self._paths += paths
                self._classes += [cls] * len(keys)
                self._sizes += sizes
                return
            order = sorted(range(len(keys)), key=keys.__getitem__)
            if need_image:
                kept = [i for i in order if exts[i] in images]
                self.left_out += len(order) - len(kept)
                order = kept
            self._keys += [keys[i] for i in order]
            self._exts += [exts[i] for i in order]
            self._paths += [paths[i] for i in order]
            self._classes += [cls] * len(order)
            self._sizes += [sizes[i] for i in order]
            return
        self._group(sorted(zip(keys, exts, paths, sizes)), cls, need_image)

    def _group(self, found: list, cls: int, need_image: bool) -> None:
        """Rows from ``found``, ``(key, ext, relative path, size)`` of each file sorted: the
        files of a key are one sample (sorted by extension), the samples in key order."""
        images = IMAGE_EXTENSIONS
        i, n = 0, len(found)
        while i < n:
            key, ext, path, size = found[i]
            j = i + 1
            if j < n and found[j][0] == key:  # several files of one sample
                while j < n and found[j][0] == key:
                    j += 1
                group = found[i:j]
                for (_, e1, p1, _), (_, e2, p2, _) in itertools.pairwise(group):
                    if e1 == e2:
                        raise ValueError(
                            f"{p1} and {p2} would both be member {key}.{e1} of one sample; "
                            "rename one"
                        )
                members = tuple((e, p) for _, e, p, _ in group)
                size = sum(s for *_, s in group)
            else:
                members = ((ext, path),)
            i = j
            if need_image:
                for e, _ in members:
                    if e in images:
                        break
                else:
                    self.left_out += 1
                    continue
            self._keys.append(key)
            if len(members) == 1:
                self._exts.append(members[0][0])
                self._paths.append(members[0][1])
            else:
                self._exts.append(None)
                self._paths.append(members)
            self._classes.append(cls)
            self._sizes.append(size)

    def _list_imagefolder(self) -> None:
        with os.scandir(self.root) as it:
            self.classes = sorted(
                e.name for e in it if e.is_dir(follow_symlinks=True) and not e.name.startswith(".")
            )
        if not self.classes:
            raise ValueError(f"{self.root} has no class folders (an ImageFolder's sub-folders)")
        for cls, name in enumerate(self.classes):
            keys: list[str] = []
            exts: list[str] = []
            paths: list[str] = []
            sizes: list[int] = []
            for rel, names, found in self._folders(os.path.join(self.root, name), name):
                # the name without its last suffix (dots left: "_"), or the whole name as .bin
                cut = [n.rpartition(".") for n in names]
                prefix = rel + "/"
                keys += [
                    prefix + (stem.replace(".", "_") if dot and stem else n)
                    for n, (stem, dot, _) in zip(names, cut)
                ]
                exts += [ext.lower() if dot and stem else "bin" for stem, dot, ext in cut]
                paths += [prefix + n for n in names]
                sizes += found
            self._add_rows(keys, exts, paths, sizes, cls, need_image=True)
        if not self._keys:
            raise ValueError(f"no images in the class folders of {self.root}")

    def _list_files(self) -> None:
        keys: list[str] = []
        exts: list[str] = []
        paths: list[str] = []
        sizes: list[int] = []
        for rel, names, found in self._folders(self.root):
            # the name before its first dot; no dot (or nothing after it): .bin
            cut = [n.partition(".") for n in names]
            prefix = rel + "/" if rel else ""
            keys += [prefix + stem for stem, _, _ in cut]
            exts += [ext if dot and ext else "bin" for _, dot, ext in cut]
            paths += [prefix + n for n in names]
            sizes += found
        self._add_rows(keys, exts, paths, sizes, -1, need_image=False)
        for key in self._keys:
            row_key(key, 0)  # names readers could not group are refused here, not mid-way
        if not self._keys:
            raise ValueError(f"no files in {self.root}")

    @property
    def rows(self) -> list[tuple[str, tuple, int]]:
        """``(key, ((ext, relative path), ...), class or -1)`` of each row."""
        return [
            (key, path if ext is None else ((ext, path),), cls)
            for key, ext, path, cls in zip(self._keys, self._exts, self._paths, self._classes)
        ]

    def count(self) -> int:
        return len(self._keys)

    def sizes(self) -> list[int] | None:
        return self._sizes if self.measured else None

    def identity(self) -> dict:
        import hashlib

        # one line a row, f"{key}\t{members}\t{cls}\t{size}\n" (members as repr() writes the
        # tuple); a single file's line formatted directly (half the time of the tuple's repr)
        lines = [
            f"{key}\t(({ext!r}, {path!r}),)\t{cls}\t{size}\n"
            if ext is not None
            else f"{key}\t{path}\t{cls}\t{size}\n"
            for key, ext, path, cls, size in zip(
                self._keys, self._exts, self._paths, self._classes, self._sizes
            )
        ]
        return {
            "kind": self.kind,
            "rows": len(self._keys),
            "listing": hashlib.sha256("".join(lines).encode()).hexdigest(),
            "sizes": self.measured,
        }

    def info(self) -> dict:
        return {"classes": list(self.classes)} if self.kind == "imagefolder" else {}

    def __getstate__(self) -> dict:
        """The columns as a few strings and arrays (unpickled in a millisecond; see the class;
        file names hold no NUL)."""
        state = dict(self.__dict__)
        state["_keys"] = "\0".join(self._keys)
        state["_classes"] = array.array("q", self._classes).tobytes()
        state["_sizes"] = array.array("q", self._sizes).tobytes()
        if None not in self._exts:  # a file a sample (else the lists as they are)
            state["_exts"] = "\0".join(self._exts)  # type: ignore[arg-type]  # no None
            state["_paths"] = "\0".join(self._paths)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        n = len(state["_classes"]) // 8
        self._keys = state["_keys"].split("\0") if n else []
        for name in ("_classes", "_sizes"):
            column = array.array("q")
            column.frombytes(state[name])
            setattr(self, name, column.tolist())
        if isinstance(state["_exts"], str):
            self._exts = list(state["_exts"].split("\0")) if n else []
            self._paths = state["_paths"].split("\0") if n else []

    def samples(self, start: int, stop: int) -> Iterator[Sample]:
        root = self.root
        rows = zip(
            self._keys[start:stop],
            self._exts[start:stop],
            self._paths[start:stop],
            self._classes[start:stop],
        )
        folders: dict[str, int] = {}  # relative folder -> a descriptor of it, for openat
        try:
            for key, ext, path, cls in rows:
                members = ((ext, path),) if ext is not None else path
                out = []
                for e, p in members:
                    if _O_DIR is None:  # no openat here: the whole path
                        out.append((e, read_file(f"{root}/{p}")))
                        continue
                    folder, _, name = p.rpartition("/")
                    fd = folders.get(folder)
                    if fd is None:
                        if len(folders) >= _OPEN_FOLDERS:
                            _close_all(folders)
                        fd = folders[folder] = os.open(
                            f"{root}/{folder}" if folder else root, _O_DIR
                        )
                    out.append((e, read_file(name, fd)))
                if cls >= 0:
                    out.append(("cls", str(cls).encode()))
                    out.sort()
                yield key, out
        finally:
            _close_all(folders)


_OPEN_FOLDERS = 64  # folders FolderSource.samples keeps open (rows in key order: few at once)


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


# ---------------------------------------------------------------------------------------------
# tables: Parquet, Hugging Face datasets (Arrow underneath), JSONL
# ---------------------------------------------------------------------------------------------


def _arrow_kind(t) -> str:
    """binary, media, string, int, scalar or nested, for an Arrow type."""
    pa = require_pyarrow()
    types = pa.types
    if types.is_dictionary(t):
        t = t.value_type
    if types.is_binary(t) or types.is_large_binary(t) or types.is_fixed_size_binary(t):
        return "binary"
    if types.is_string(t) or types.is_large_string(t):
        return "string"
    if types.is_integer(t):
        return "int"
    if types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" in names:
            inner = t.field(names.index("bytes")).type
            if types.is_binary(inner) or types.is_large_binary(inner):
                return "media"
        return "nested"
    if types.is_list(t) or types.is_large_list(t) or types.is_map(t):
        return "nested"
    if getattr(types, "is_fixed_size_list", lambda _: False)(t):
        return "nested"
    return "scalar"


class _TableSource(Source):
    """Rows that come as Arrow tables: the member plan, keys, and table -> samples."""

    columns: list[Column]
    key: str | None
    base: str | None = None  # the folder a media struct's relative path is taken from

    def _setup(self, schema, first_rows, *, fields, extensions, key, labels, stored: dict):
        names = list(schema.names)
        if key is None:
            key = stored.get("key")
            if key is None and "__key__" in names:
                key = "__key__"
        if key is not None and key not in names:
            raise ValueError(f"no key column {key!r} (the columns: {', '.join(names)})")
        self.key = key
        chosen = [n for n in names if n != key]
        if fields is not None:
            fields = list(fields)
            missing = [f for f in fields if f not in names]
            if missing:
                raise ValueError(
                    f"no column {', '.join(map(repr, missing))} (the columns: {', '.join(names)})"
                )
            chosen = [n for n in fields if n != key]
        if not chosen:
            raise ValueError("no columns to write")
        kinds = {n: _arrow_kind(schema.field(n).type) for n in chosen}
        samples = {
            n: first_rows.column(n).to_pylist()
            for n in chosen
            if kinds[n] in ("binary", "media") and first_rows is not None
        }
        given = {c: e for c, e in (stored.get("extensions") or {}).items() if c in kinds}
        given.update(extensions or {})
        self.columns = plan_columns(kinds, samples, extensions=given, labels=set(labels))

    def _read_file(self, path: str) -> bytes:
        if self.base is not None and not os.path.isabs(path):
            path = os.path.join(self.base, path)
        return read_file(path)

    def _table_samples(self, table, first_row: int) -> Iterator[Sample]:
        n = table.num_rows
        cols = [(c, table.column(c.name).to_pylist()) for c in self.columns]
        if self.key is not None:
            keys = [
                row_key(v, first_row + i) for i, v in enumerate(table.column(self.key).to_pylist())
            ]
        else:
            width = self._width
            keys = [f"{first_row + i:0{width}d}" for i in range(n)]
        read = self._read_file
        for i in range(n):
            members = []
            for col, values in cols:
                data = value_bytes(col, values[i], read)
                if data is not None:
                    members.append((col.ext, data))
            if not members:
                raise ValueError(f"row {first_row + i} ({keys[i]}) has no field to write")
            members.sort()
            yield keys[i], members

    @property
    def _width(self) -> int:
        return _row_keys(self.count())

    def _plan_identity(self) -> list:
        return [self.key, [[c.name, c.ext, c.how] for c in self.columns]]


def _parquet_files(src) -> list[str]:
    if isinstance(src, (list, tuple)):
        files = [os.path.abspath(os.fspath(p)) for p in src]
    else:
        path = os.path.abspath(os.fspath(src))
        if os.path.isdir(path):
            files = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
                files += [
                    os.path.join(dirpath, f)
                    for f in sorted(filenames)
                    if f.endswith(".parquet") and not f.startswith((".", "_"))
                ]
        else:
            files = [path]
    if not files:
        raise ValueError(f"no .parquet files in {src}")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no such Parquet file: {f}")
    return files


class ParquetSource(_TableSource):
    """Parquet files (a file, a list, or a folder of them: a Parquet data set, read in sorted
    path order); a row is a sample. Files written by ``tarshards convert SPEC -o X.parquet``
    carry their key column and extensions in the schema's metadata, so they convert back to the
    same members."""

    kind = "parquet"

    def __init__(self, src, *, fields=None, extensions=None, key=None):
        pq = require_pyarrow().parquet
        self.files = _parquet_files(src)
        self.base = os.path.dirname(self.files[0])
        # per file: its row groups' row counts; per row group a row size estimate
        self.groups: list[list[int]] = []
        self._row_bytes: list[list[int]] = []
        schema = pq.ParquetFile(self.files[0]).schema_arrow
        self.stat: list[tuple[str, int, int]] = []
        for f in self.files:
            md = pq.ParquetFile(f).metadata
            self.groups.append([md.row_group(g).num_rows for g in range(md.num_row_groups)])
            self._row_bytes.append(
                [
                    md.row_group(g).total_byte_size // max(1, md.row_group(g).num_rows)
                    for g in range(md.num_row_groups)
                ]
            )
            self.stat.append((os.path.basename(f), md.num_rows, os.path.getsize(f)))
        stored = {}
        if schema.metadata and b"tarshards" in schema.metadata:
            stored = json.loads(schema.metadata[b"tarshards"])
        self.stored_info = stored.get("info") or {}
        first = None
        for f, groups in zip(self.files, self.groups):
            if groups and sum(groups):
                first = pq.ParquetFile(f).read_row_group(0).slice(0, _INFER_ROWS)
                break
        self._setup(
            schema, first, fields=fields, extensions=extensions, key=key, labels=(), stored=stored
        )
        self._n = sum(sum(g) for g in self.groups)

    def count(self) -> int:
        return self._n

    def sizes(self) -> list[int]:
        out: list[int] = []
        for groups, sizes in zip(self.groups, self._row_bytes):
            for rows, size in zip(groups, sizes):
                out += [size] * rows
        return out

    def identity(self) -> dict:
        return {"kind": self.kind, "files": self.stat, "plan": self._plan_identity()}

    def info(self) -> dict:
        return dict(self.stored_info)

    def samples(self, start: int, stop: int) -> Iterator[Sample]:
        pq = require_pyarrow().parquet
        needed = [c.name for c in self.columns] + ([self.key] if self.key else [])
        pos = 0
        for f, groups in zip(self.files, self.groups):
            file_rows = sum(groups)
            if pos + file_rows <= start or pos >= stop:
                pos += file_rows
                continue
            pf = pq.ParquetFile(f)
            for g, rows in enumerate(groups):
                lo, hi = max(start, pos), min(stop, pos + rows)
                if lo < hi:
                    table = pf.read_row_group(g, columns=needed).slice(lo - pos, hi - lo)
                    yield from self._table_samples(table, lo)
                pos += rows
                if pos >= stop:
                    return


class HFSource(_TableSource):
    """A Hugging Face ``datasets.Dataset`` (or the folder ``save_to_disk`` wrote; with a
    ``DatasetDict``, ``split=`` chooses one). Rows are read as Arrow (no decoding): ``Image`` and
    ``Audio`` features are written as their encoded bytes, ``ClassLabel`` as ``cls`` with the
    class names in the manifest's ``info``."""

    kind = "hf"

    def __init__(self, src, *, split=None, fields=None, extensions=None, key=None):
        datasets = _datasets()
        self.path = None
        if isinstance(src, (str, os.PathLike)):
            self.path = os.path.abspath(os.fspath(src))
            ds = datasets.load_from_disk(self.path)
        else:
            ds = src
        self.split = split
        if isinstance(ds, datasets.DatasetDict):
            if split is None:
                if len(ds) != 1:
                    raise ValueError(
                        f"the dataset has splits {', '.join(ds)}: choose one with split="
                    )
                split = next(iter(ds))
            if split not in ds:
                raise ValueError(f"no split {split!r} (the splits: {', '.join(ds)})")
            self.split = split
            ds = ds[split]
        elif split is not None and self.path is None:
            raise ValueError("split= is for a DatasetDict")
        if not isinstance(ds, datasets.Dataset):
            raise TypeError(f"not a datasets.Dataset: {type(ds).__name__}")
        self._ds = ds
        self._arrow = None
        self._n = len(ds)
        features = ds.features
        labels = {}
        for name, feature in features.items():
            if isinstance(feature, datasets.ClassLabel):
                labels[name] = list(feature.names)
        schema = features.arrow_schema
        first = self._rows(0, min(self._n, _INFER_ROWS)) if self._n else None
        self._setup(
            schema, first, fields=fields, extensions=extensions, key=key, labels=labels, stored={}
        )
        self._labels = {c.ext: labels[c.name] for c in self.columns if c.name in labels}
        self._features = repr(features)
        self._files = [
            (os.path.basename(f["filename"]), os.path.getsize(f["filename"]))
            for f in ds.cache_files
            if os.path.exists(f["filename"])
        ]
        self._nbytes = int(ds.data.nbytes)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arrow"] = None
        if self.path is not None:  # reopened from the folder in the worker
            state["_ds"] = None
        return state

    def _dataset(self):
        if self._ds is None:
            ds = _datasets().load_from_disk(self.path)
            self._ds = ds[self.split] if self.split is not None else ds
        return self._ds

    def _rows(self, start: int, stop: int):
        if self._arrow is None:
            self._arrow = self._dataset().with_format("arrow")
        return self._arrow[start:stop]

    def count(self) -> int:
        return self._n

    def sizes(self) -> list[int]:
        return [self._nbytes // max(1, self._n)] * self._n

    def identity(self) -> dict:
        return {
            "kind": self.kind,
            "path": self.path,
            "split": self.split,
            "rows": self._n,
            "features": self._features,
            "files": self._files,
            "plan": self._plan_identity(),
        }

    def info(self) -> dict:
        if not self._labels:
            return {}
        if "cls" in self._labels:
            out: dict = {"classes": self._labels["cls"]}
            rest = {e: n for e, n in self._labels.items() if e != "cls"}
            if rest:
                out["class_names"] = rest
            return out
        return {"class_names": self._labels}

    def samples(self, start: int, stop: int) -> Iterator[Sample]:
        step = 1000
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            yield from self._table_samples(self._rows(lo, hi), lo)


class JsonlSource(_TableSource):
    """JSON Lines, one sample per line. Fields whose values name files (paths relative to the
    JSONL file's folder, or absolute) become members holding those files' bytes, the extension
    taken from the file name; the other fields follow the column rules
    (:mod:`tarshards.convert.columns`). A field is a file field when, in the first rows, its
    string values name files that exist."""

    kind = "jsonl"

    def __init__(self, path, *, fields=None, extensions=None, key=None):
        self.path = os.path.abspath(os.fspath(path))
        self.base = os.path.dirname(self.path)
        self.offsets: list[int] = []
        names: dict[str, str] = {}
        firsts: dict[str, list] = {}
        file_fields: set = set()
        pos = 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    self.offsets.append(pos)
                    if len(self.offsets) <= _INFER_ROWS:
                        row = self._parse(line, len(self.offsets) - 1)
                        for name, value in row.items():
                            names.setdefault(name, "")
                            if value is not None:
                                firsts.setdefault(name, []).append(value)
                pos += len(line)
        if not self.offsets:
            raise ValueError(f"{self.path} has no rows")
        self._nbytes = pos
        kinds: dict[str, str] = {}
        for name in names:
            values = firsts.get(name, [])
            if values and all(isinstance(v, str) for v in values):
                if any(os.path.isfile(self._resolve(v)) for v in values[:_INFER_ROWS]):
                    file_fields.add(name)
                    kinds[name] = "media"
                else:
                    kinds[name] = "string"
            elif values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                kinds[name] = "int"
            elif values and all(isinstance(v, (dict, list)) for v in values):
                kinds[name] = "nested"
            elif values and all(isinstance(v, (int, float, bool)) for v in values):
                kinds[name] = "scalar"
            else:
                kinds[name] = "nested" if values else "string"
        self.file_fields = frozenset(file_fields)
        if key is None and "__key__" in kinds:
            key = "__key__"
        if key is not None and key not in kinds:
            raise ValueError(f"no key field {key!r} (the fields: {', '.join(kinds)})")
        self.key = key
        chosen = [n for n in kinds if n != key]
        if fields is not None:
            missing = [f for f in fields if f not in kinds]
            if missing:
                raise ValueError(f"no field {', '.join(map(repr, missing))} in {self.path}")
            chosen = [n for n in fields if n != key]
        samples = {n: [{"path": v} for v in firsts.get(n, [])] for n in chosen if n in file_fields}
        self.columns = plan_columns({n: kinds[n] for n in chosen}, samples, extensions=extensions)

    def _parse(self, line: bytes, row: int) -> dict:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{self.path}: row {row} is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{self.path}: row {row} is not a JSON object")
        return obj

    def _resolve(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(os.path.dirname(self.path), path)

    def count(self) -> int:
        return len(self.offsets)

    def sizes(self) -> list[int]:
        """Each line's length plus the sizes of the files it names (a ``stat`` each)."""
        out: list[int] = []
        files = self.file_fields
        with open(self.path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                size = len(line)
                if files:
                    obj = self._parse(line, len(out))
                    for name in files:
                        value = obj.get(name)
                        if isinstance(value, str):
                            try:
                                size += os.stat(self._resolve(value)).st_size
                            except OSError:
                                pass  # reported when the shard is written
                out.append(size)
        return out

    def identity(self) -> dict:
        st = os.stat(self.path)
        return {
            "kind": self.kind,
            "path": self.path,
            "size": st.st_size,
            "rows": len(self.offsets),
            "plan": self._plan_identity(),
        }

    def samples(self, start: int, stop: int) -> Iterator[Sample]:
        width = self._width
        files = self.file_fields
        with open(self.path, "rb") as f:
            f.seek(self.offsets[start])
            row = start
            while row < stop:
                line = f.readline()
                if not line.strip():
                    continue
                obj = self._parse(line, row)
                if self.key is not None:
                    key = row_key(obj.get(self.key), row)
                else:
                    key = f"{row:0{width}d}"
                members = []
                for col in self.columns:
                    value = obj.get(col.name)
                    if col.name in files and isinstance(value, str):
                        value = {"path": value}
                    data = value_bytes(col, value, self._read_file)
                    if data is not None:
                        members.append((col.ext, data))
                if not members:
                    raise ValueError(f"{self.path}: row {row} ({key}) has no field to write")
                members.sort()
                yield key, members
                row += 1


# ---------------------------------------------------------------------------------------------
# choosing
# ---------------------------------------------------------------------------------------------


def _is_hf_object(src) -> bool:
    return type(src).__module__.split(".")[0] == "datasets"


def _looks_like_imagefolder(root: str) -> bool:
    """No visible files at the top, and images one folder down (or deeper)."""
    with os.scandir(root) as it:
        entries = [e for e in it if not e.name.startswith(".")]
    if any(e.is_file() for e in entries) or not entries:
        return False
    for e in entries:
        if e.is_dir():
            for _, _, filenames in os.walk(e.path):
                if any(f.rpartition(".")[2].lower() in IMAGE_EXTENSIONS for f in filenames):
                    return True
    return False


def detect_kind(src) -> str:
    """The kind of ``src``: ``hf`` (a ``datasets`` object, or a ``save_to_disk`` folder),
    ``parquet`` (a ``.parquet`` file, a list of them, or a folder holding only Parquet files),
    ``jsonl`` (``.jsonl``/``.ndjson``), ``imagefolder`` (a folder of class folders of images) or
    ``files`` (any other folder)."""
    if _is_hf_object(src):
        return "hf"
    if isinstance(src, (list, tuple)):
        if src and all(os.fspath(p).endswith(".parquet") for p in src):
            return "parquet"
        raise ValueError("a list of sources must name .parquet files")
    path = os.fspath(src)
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & {"dataset_info.json", "dataset_dict.json", "state.json"}:
            return "hf"
        # a Parquet data set: Parquet files only (the _SUCCESS and _metadata files aside); the
        # walk stops at the first other file (a folder of images is not listed twice)
        files = (f for _, _, fs in os.walk(path) for f in fs if not f.startswith((".", "_")))
        first = next(files, None)
        if first is not None and first.endswith(".parquet"):
            if all(f.endswith(".parquet") for f in files):
                return "parquet"
        return "imagefolder" if _looks_like_imagefolder(path) else "files"
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or folder: {path}")
    lowered = path.lower()
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    raise ValueError(
        f"cannot tell what kind of source {path} is; name it with kind= (--from): "
        f"{', '.join(KINDS)}"
    )


def open_source(
    src,
    kind: str | None = None,
    *,
    fields=None,
    extensions=None,
    key=None,
    split=None,
    sizes: bool = True,
) -> Source:
    """The :class:`Source` for ``src`` (of ``kind``, or the kind :func:`detect_kind` finds);
    ``sizes=False``: a folder's files are not measured (shards cut by count only)."""
    if kind is None:
        kind = detect_kind(src)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind in ("imagefolder", "files"):
        if extensions or key is not None:
            raise ValueError(
                "extensions= and key= are for tables (parquet, hf, jsonl); a folder's "
                "extensions and keys come from its file names"
            )
        return FolderSource(src, kind, fields=fields, sizes=sizes)
    if kind == "parquet":
        return ParquetSource(src, fields=fields, extensions=extensions, key=key)
    if kind == "hf":
        return HFSource(src, split=split, fields=fields, extensions=extensions, key=key)
    return JsonlSource(src, fields=fields, extensions=extensions, key=key)
