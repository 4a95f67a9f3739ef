"""Video clips from tar members: seeking vs decoding from the start, workers, remote bytes.

    .venv/bin/python bench/bench_media.py            # all rows
    .venv/bin/python bench/bench_media.py --quick    # fewer clips and samples
    .venv/bin/python bench/bench_media.py --json
    .venv/bin/python bench/bench_media.py --only phases   # where a clip's time goes (4.)

The member: a 30 s 640x360 video at 30 fps (900 frames), H.264 (libx264, ``veryfast``, crf 23,
a keyframe every 2 s: a common encoding of web video; mpeg4 where the PyAV wheel lacks
libx264), made here once into ``bench/_data/media/`` from moving noise (a realistic bitrate).

1. ``seek``: a random 16-frame clip (consecutive frames), ``tarshards.video(frames=16)
   .decode(bytes)`` (seeks to the keyframe before the clip, decodes forward, converts the 16
   frames to RGB) against PyAV decoding from the start (``av.open``, ``container.decode``
   until the clip's last frame, the clip's 16 frames converted to RGB), both in this process
   on the same bytes in memory and the same clip starts (the reference decodes the start our
   decoder drew); the two clips are checked equal. Target: >= 3x.
2. ``loader``: clips/s of ``WebDataset(shards).decode(tarshards.video(frames=16))
   .to_tuple("mp4", "cls")`` over 4 shards of 32 such members (16 with --quick): one process
   decoding on one thread (``threads=1``), one process with FFmpeg's threads (the decoder's
   default in a lone process: slice threads), one process with frame and slice threads
   (``thread_type="auto"``: the most a process gets from FFmpeg on a stream of one slice a
   frame, for more CPU time), and ``WebLoader(num_workers=2)`` (the decoder's default in a
   worker: its share of the cores, one thread each on 2 cores), in turns, medians of 3 passes,
   over the whole epoch and after its first clip (the workers' start-up left out). The ratio is
   the workers' rate against the best one-process rate. Target: >= 1.6x on a host with 2
   free cores. The CPU time a clip costs each (with the loader its workers too, counted once
   they exit) and the cores each used (CPU over wall time) say what bounds the ratio, and what
   it would be with free cores where the host is shared: two workers reach at most 2 cores /
   their CPU a clip, and one process with FFmpeg's threads uses more than one core where the
   codec lets its threads share a frame (this member has 2 slices a frame: libx264's slice
   threads on the 2-core host that encoded it). The row runs on two members of the same
   frames: first one slice a frame, as the ``ffmpeg`` command's libx264 writes by default (its
   frame threads), where FFmpeg's threads cannot share a frame's decode and one process uses
   one core; then the 2-slice member, where one process with slice threads already uses about
   1.4 cores, so that two workers on 2 cores reach at most about 2 / 1.4 = 1.43x of it
   (``--one-slice``: the first only; ``--sliced``: the second only).
3. ``remote``: ``IndexedDataset(manifest over HTTP, decode=tarshards.video(frames=60))`` (a 2 s
   clip) against the test HTTP server (``tests/integration/servers.py``), the body bytes the
   server sent per clip against the member's size, and its requests; with the plain index,
   then with the keyframe table (``tarshards index --media --keyframes``).
4. ``phases`` (only with ``--only phases``): where a clip's time goes in one process (one
   thread; FFmpeg's threads) and in each ``WebLoader(num_workers=2)`` worker: the thread CPU and
   wall time of opening and probing the container, seeking and decoding, converting to RGB,
   and the transport's copy into the worker's slot; each process's CPU time and context
   switches a clip.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import json
import os
import random
import resource
import statistics
import sys
import time
import zlib
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "_data", "media")
sys.path.insert(0, HERE)

import av  # noqa: E402
from common import machine_info  # noqa: E402

import tarshards  # noqa: E402


def make_member(
    seconds: int = 30, fps: int = 30, width: int = 640, height: int = 360, one_slice: bool = False
) -> bytes:
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    tail = "-1slice" if one_slice else ""
    path = os.path.join(DATA, f"member-{seconds}s-{height}p-{codec}{tail}.mp4")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    os.makedirs(DATA, exist_ok=True)
    rng = np.random.default_rng(0)
    # a textured scene: coarse noise blown up 8x, plus fine noise (about 1 Mbit/s in H.264)
    coarse = rng.integers(0, 255, (height // 4, width // 4, 3), np.uint8)
    base = np.repeat(np.repeat(coarse, 8, 0), 8, 1)
    base = (base // 2 + rng.integers(0, 24, base.shape, np.uint8)).astype(np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height = width, height
        s.pix_fmt = "yuv420p"
        s.gop_size = 2 * fps
        if one_slice:  # libx264's frame threads (as the ffmpeg command writes): a slice a frame
            s.thread_type = "FRAME"
        if codec == "libx264":
            s.options = {"preset": "veryfast", "crf": "23", "keyint_min": str(2 * fps)}
        else:
            s.codec_context.bit_rate = 1_500_000
        for i in range(seconds * fps):
            y, x = (i * 3) % height, (i * 5) % width
            img = np.ascontiguousarray(base[y : y + height, x : x + width])
            img[:8, : (i % width) + 1] = 255  # a bar that grows: every frame differs
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    data = buf.getvalue()
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return data


def clip_from_start(data: bytes, first: int, frames: int = 16):
    """PyAV from the start: decode until frame ``first + frames - 1``, convert the clip."""
    out = []
    with av.open(io.BytesIO(data)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i >= first:
                out.append(f.to_ndarray(format="rgb24"))
                if len(out) == frames:
                    break
    return np.stack(out)


def row_seek(data: bytes, clips: int) -> dict:
    dec = tarshards.video(frames=16, output="numpy")
    with av.open(io.BytesIO(data)) as c:
        fps = float(c.streams.video[0].average_rate)
    ours_s, ref_s, starts = [], [], []
    for k in range(clips):
        t0 = time.perf_counter()
        clip = dec.decode(data, random.Random(k))
        ours_s.append(time.perf_counter() - t0)
        first = int(round(float(clip.timestamps[0]) * fps))
        starts.append(first)
        t0 = time.perf_counter()
        ref = clip_from_start(data, first)
        ref_s.append(time.perf_counter() - t0)
        if not np.array_equal(ref, clip.frames):
            raise AssertionError(f"clip {k} (start frame {first}) differs from PyAV's")
    ours, ref = sum(ours_s), sum(ref_s)
    return {
        "clips": clips,
        "ours_ms_per_clip": 1000 * ours / clips,
        "from_start_ms_per_clip": 1000 * ref / clips,
        "speedup": ref / ours,
        "mean_start_frame": statistics.mean(starts),
        "target": 3.0,
    }


def _shards(data: bytes, shards: int, per_shard: int) -> list[str]:
    paths = [os.path.join(DATA, f"clips-{i}.tar") for i in range(shards)]
    tag = f"{shards}x{per_shard}-{len(data)}-{zlib.crc32(data):08x}"
    stamp = os.path.join(DATA, f"clips-{tag}.done")
    if not os.path.exists(stamp):
        for old in os.listdir(DATA):  # the shards of another size: written again below
            if old.startswith("clips-") and old.endswith(".done"):
                os.remove(os.path.join(DATA, old))
        with tarshards.ShardWriter(os.path.join(DATA, "clips-%d.tar"), maxcount=per_shard) as w:
            for i in range(shards * per_shard):
                w.write({"__key__": f"v{i:04d}", "mp4": data, "cls": i})
        open(stamp, "w").close()
    return paths


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def row_loader(data: bytes, shards: int, per_shard: int, passes: int) -> dict:
    """Clips/s of one process decoding on one thread, one process with FFmpeg's threads (the
    decoder's default there), and ``WebLoader(num_workers=2)`` (its default there: each worker
    its share of the cores), in turns; with the CPU time a clip costs in each."""
    import torch

    torch.set_num_threads(1)
    urls = _shards(data, shards, per_shard)

    def make(threads, thread_type="slice"):
        return (
            tarshards.WebDataset(urls, shardshuffle=False, seed=0)
            .decode(tarshards.video(frames=16, threads=threads, thread_type=thread_type))
            .to_tuple("mp4", "cls")
            .map_tuple(lambda c: c.frames, None)
        )

    def steady(it) -> tuple[int, float, float]:
        """Items, seconds for all, seconds after the first (start-up left out)."""
        t0 = time.perf_counter()
        n, first = 0, None
        for _ in it:
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return n, end - t0, end - (first or t0)

    def one_process(threads, thread_type="slice") -> tuple[float, float, float]:
        c0 = _cpu(resource.RUSAGE_SELF)
        n, secs, after = steady(make(threads, thread_type))
        cpu = _cpu(resource.RUSAGE_SELF) - c0
        return n / secs, (n - 1) / after, cpu / n

    def loader() -> tuple[float, float, float]:
        # CPU: this process and its workers (counted once they have exited and been reaped)
        c0 = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
        ld = tarshards.WebLoader(make(None), num_workers=2, batch_size=None)
        n, secs, after = steady(ld)
        del ld
        gc.collect()
        c1 = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
        return n / secs, (n - 1) / after, (c1 - c0) / n

    rows: dict[str, Callable[[], tuple[float, float, float]]] = {
        "one_thread": lambda: one_process(1),
        "ffmpeg_threads": lambda: one_process(None),
        "frame_threads": lambda: one_process(None, "auto"),
        "workers2": loader,
    }
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in rows}
    order = list(rows)
    for p in range(passes):  # in turns, the order turned each pass
        for name in order[p % len(order) :] + order[: p % len(order)]:
            got[name].append(rows[name]())
    out: dict = {"samples": shards * per_shard, "passes": passes, "target": 1.6}
    for name, runs in got.items():
        out[name] = {
            "clips_per_s": statistics.median(r[0] for r in runs),
            "steady_clips_per_s": statistics.median(r[1] for r in runs),
            "cpu_ms_per_clip": 1000 * statistics.median(r[2] for r in runs),
        }
        # cores used: CPU time over wall time
        out[name]["cores"] = out[name]["cpu_ms_per_clip"] * out[name]["clips_per_s"] / 1000
    singles = ("one_thread", "ffmpeg_threads", "frame_threads")
    best = max(out[k]["clips_per_s"] for k in singles)
    two = out["workers2"]
    out["ratio"] = two["clips_per_s"] / best  # against the best a process did
    for k in singles:
        out[f"ratio_{k}"] = two["clips_per_s"] / out[k]["clips_per_s"]
    # what two free cores allow the workers, from the CPU time a clip costs them (and this
    # process), against one thread's CPU time a clip
    out["two_cores_ratio_one_thread"] = (
        2 * out["one_thread"]["cpu_ms_per_clip"] / two["cpu_ms_per_clip"]
    )
    return out


class _Phases:
    """Where a clip's time goes, process by process (``--only phases``): the thread CPU time
    and wall time of the decoder's parts (the container opened and probed, seek and decode, the
    conversion to RGB) and of the transport's copy into a worker's slot, summed in each process
    (the workers write theirs to ``folder`` as they exit), beside the process's CPU time."""

    PARTS = (
        ("VideoDecoder.decode", "decode, all of it"),
        ("open_container", "  open and probe"),
        ("VideoDecoder._collect", "  seek and decode"),
        ("VideoDecoder._rgb", "  to RGB"),
        ("Packer.__call__", "transport: into the slot"),
    )

    def __init__(self, folder: str):
        from tarshards import transport
        from tarshards.media import video as video_module

        self.folder = folder
        self.acc: dict[str, list[float]] = {}
        owners = {"VideoDecoder": video_module.VideoDecoder, "Packer": transport.Packer}
        for path, label in self.PARTS:
            owner_name, _, attr = path.rpartition(".")
            owner = owners.get(owner_name, video_module)
            setattr(owner, attr, self._timed(label, getattr(owner, attr)))

    def _timed(self, label: str, fn):
        acc = self.acc

        def timed(*args, **kwargs):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                a = acc.setdefault(label, [0.0, 0.0])
                a[0] += time.thread_time() - c
                a[1] += time.perf_counter() - w

        return timed

    def reset(self) -> tuple[float, int]:
        self.acc.clear()
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw

    def snapshot(self, start: tuple[float, int], clips: int) -> dict:
        r = resource.getrusage(resource.RUSAGE_SELF)
        out = {k: (1000 * c / clips, 1000 * w / clips) for k, (c, w) in self.acc.items()}
        out["process CPU"] = (1000 * (r.ru_utime + r.ru_stime - start[0]) / clips, 0.0)
        out["context switches"] = ((r.ru_nvcsw + r.ru_nivcsw - start[1]) / clips, 0.0)
        return out

    def worker_init(self, worker_id: int) -> None:
        from multiprocessing import util

        start = self.reset()

        def dump():
            clips = int(self.acc.get("decode, all of it", [0, 0])[0] > 0) and self.clips
            path = os.path.join(self.folder, f"worker-{worker_id}.json")
            with open(path, "w") as f:
                json.dump(self.snapshot(start, max(clips, 1)), f)

        self.clips = 0
        util.Finalize(None, dump, exitpriority=100)

    def count(self, item):
        self.clips += 1
        return item


def row_phases(data: bytes, shards: int, per_shard: int) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(1)
    urls = _shards(data, shards, per_shard)
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        ph = _Phases(d)
        ph.clips = 0

        def make(threads):
            return (
                tarshards.WebDataset(urls, shardshuffle=False, seed=0)
                .decode(tarshards.video(frames=16, threads=threads))
                .to_tuple("mp4", "cls")
                .map_tuple(lambda c: ph.count(c.frames), None)
            )

        for name, threads in (("one process, one thread", 1), ("one process, FFmpeg's", None)):
            start = ph.reset()
            n = sum(1 for _ in make(threads))
            out[name] = ph.snapshot(start, n)
        ld = tarshards.WebLoader(
            make(None), num_workers=2, batch_size=None, worker_init_fn=ph.worker_init
        )
        start = ph.reset()
        n = sum(1 for _ in ld)
        main = ph.snapshot(start, n)
        del ld
        gc.collect()
        for w in range(2):
            path = os.path.join(d, f"worker-{w}.json")
            for _ in range(50):  # the workers write as they exit
                if os.path.exists(path):
                    break
                time.sleep(0.1)
            with open(path) as f:
                out[f"WebLoader worker {w}"] = json.load(f)
        out["WebLoader main process (per clip of all)"] = {
            k: main[k] for k in ("process CPU", "context switches")
        }
    return out


def row_remote(data: bytes, clips: int) -> dict:
    import importlib.util as iu
    import tempfile

    spec = iu.spec_from_file_location(
        "servers", os.path.join(HERE, "..", "tests", "integration", "servers.py")
    )
    servers = iu.module_from_spec(spec)
    spec.loader.exec_module(servers)
    with tempfile.TemporaryDirectory() as d:
        with tarshards.ShardWriter(os.path.join(d, "r-%02d.tar"), manifest=f"{d}/r.json") as w:
            w.write({"__key__": "a", "mp4": data, "txt": "a 30 s member"})
        out: dict = {"clips": clips, "member_bytes": len(data)}
        for keyframes in (False, True):
            if keyframes:  # the index's keyframe table: the clip's packets in one request
                from tarshards.media.metadata import add_media_meta

                add_media_meta(f"{d}/r.json", keyframes=True)
            with servers.HTTPFileServer(d) as srv:
                ds = tarshards.IndexedDataset(
                    f"{srv.url}/r.json", decode=tarshards.video(frames=60, output="numpy")
                )
                ds[0]  # the manifest and the index loaded, the client connected
                sent, secs, gets = [], [], []
                for _ in range(clips):
                    srv.reset()
                    t0 = time.perf_counter()
                    clip = ds[0]["mp4"]
                    secs.append(time.perf_counter() - t0)
                    assert clip.frames.shape[0] == 60
                    sent.append(srv.bytes_sent("/r-00.tar"))
                    gets.append(srv.gets("/r-00.tar"))
            out["keyframes" if keyframes else "plain"] = {
                "mean_bytes_per_clip": statistics.mean(sent),
                "max_fraction": max(sent) / len(data),
                "mean_fraction": statistics.mean(sent) / len(data),
                "requests_per_clip": statistics.mean(gets),
                "ms_per_clip": 1000 * statistics.mean(secs),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["seek", "loader", "remote", "phases"], default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--one-slice",
        action="store_true",
        help="the member encoded with libx264's frame threads, one slice a frame (as the ffmpeg "
        "command writes it); by default PyAV's slice threads, as many slices as the encoding "
        "host had threads (2 here)",
    )
    ap.add_argument(
        "--sliced",
        action="store_true",
        help="the loader row on the default member only (2 slices a frame), not on both",
    )
    args = ap.parse_args()
    data = make_member(one_slice=args.one_slice)
    out: dict = {"machine": machine_info(), "member_bytes": len(data)}
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        out["member"] = f"{s.codec_context.width}x{s.codec_context.height} {s.codec_context.name}"
    if args.only in (None, "seek"):
        out["seek"] = row_seek(data, 8 if args.quick else 24)
    if args.only in (None, "loader") and importlib.util.find_spec("torch") is not None:
        load0 = os.getloadavg()[0]
        # on both members unless one is asked for: one slice a frame (what the ffmpeg command
        # writes), then the member of the other rows
        members = {"one slice a frame": make_member(one_slice=True)}
        if not args.one_slice:
            members["2 slices a frame"] = data
        if args.sliced:
            members = {"2 slices a frame": data}
        out["loader"] = {
            name: row_loader(m, 4, 16 if args.quick else 32, 3) for name, m in members.items()
        }
        out["load"] = (load0, os.getloadavg()[0])
    if args.only == "phases":
        out["phases"] = row_phases(data, 4, 16 if args.quick else 32)
    if args.only in (None, "remote") and importlib.util.find_spec("aiohttp") is not None:
        out["remote"] = row_remote(data, 5 if args.quick else 10)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"member: 30 s {out['member']}, {len(data) / 1e6:.1f} MB")
    if "seek" in out:
        r = out["seek"]
        print(
            f"seek    random 16-frame clip: ours {r['ours_ms_per_clip']:.1f} ms, PyAV from the "
            f"start {r['from_start_ms_per_clip']:.1f} ms: {r['speedup']:.2f}x (target >= 3)"
        )
    if "loader" in out:
        for member, r in out["loader"].items():
            a, b, f, w = r["one_thread"], r["ffmpeg_threads"], r["frame_threads"], r["workers2"]
            best = max(a["clips_per_s"], b["clips_per_s"], f["clips_per_s"])
            print(
                f"loader  on the member of {member}, clips/s: WebLoader(num_workers=2) "
                f"{w['clips_per_s']:.1f} against the best one process {best:.1f}: "
                f"{r['ratio']:.2f}x (target >= 1.6); one process on one thread "
                f"{a['clips_per_s']:.1f} ({r['ratio_one_thread']:.2f}x), with FFmpeg's slice "
                f"threads (the default) {b['clips_per_s']:.1f} ({r['ratio_ffmpeg_threads']:.2f}x), "
                f"with frame and slice threads {f['clips_per_s']:.1f} "
                f"({r['ratio_frame_threads']:.2f}x)"
            )
            print(
                f"        CPU a clip (cores used): one thread {a['cpu_ms_per_clip']:.1f} ms "
                f"({a['cores']:.2f}), slice threads {b['cpu_ms_per_clip']:.1f} ms "
                f"({b['cores']:.2f}), frame threads {f['cpu_ms_per_clip']:.1f} ms "
                f"({f['cores']:.2f}), WebLoader workers and main {w['cpu_ms_per_clip']:.1f} ms "
                f"({w['cores']:.2f}): on 2 free cores the workers reach at most "
                f"{r['two_cores_ratio_one_thread']:.2f}x one thread"
            )
            print(
                f"        after the first clip {a['steady_clips_per_s']:.1f} / "
                f"{b['steady_clips_per_s']:.1f} / {f['steady_clips_per_s']:.1f} / "
                f"{w['steady_clips_per_s']:.1f}; load average {out['load'][0]:.1f} before, "
                f"{out['load'][1]:.1f} after"
            )
    if "phases" in out:
        print("phases  ms a clip, thread CPU / wall (a process's CPU time counts all its threads)")
        for who, parts in out["phases"].items():
            print(f"  {who}")
            for k, (c, w) in parts.items():
                if k == "context switches":
                    print(f"    {k:<26} {c:7.1f}")
                else:
                    print(f"    {k:<26} {c:7.2f}" + (f" / {w:7.2f}" if w else ""))
    if "remote" in out:
        r = out["remote"]
        for name in ("plain", "keyframes"):
            k = r[name]
            print(
                f"remote  2 s clip over HTTP ({name + ' index':<15}): "
                f"{k['mean_bytes_per_clip'] / 1e3:.0f} KB of a {r['member_bytes'] / 1e6:.1f} MB "
                f"member ({100 * k['mean_fraction']:.1f}% mean, {100 * k['max_fraction']:.1f}% "
                f"max), {k['requests_per_clip']:.1f} requests, {k['ms_per_clip']:.0f} ms a clip"
            )


if __name__ == "__main__":
    main()
