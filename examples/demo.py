"""The main job, end to end: ``make demo``.

1. converts scikit-learn's handwritten digits (1797 8x8 images) into 32x32 PNG samples with a class
   label and a little JSON, sharded into train/test tars with ``tarshards.ShardWriter``;
2. inspects the shards with the command-line tools ``tarshow``, ``tar2tsv`` and ``tarcheck`` (run as
   real subprocesses) and writes a contact sheet PNG (``tarshow --images``);
3. trains a small PyTorch CNN for a few epochs, streaming the train shards through
   ``tarshards.WebDataset`` (shard + buffer shuffling, random shifts/rotations, a 2-worker
   ``WebLoader``), printing loss, test accuracy and samples/s per epoch;
4. processes the shards in parallel into new shards (images resized to 64x64) with
   ``tarshards.parallel.map_shards`` on local processes, then again on a local Dask cluster, and
   once more from the shell with ``tarshards map --engine dask``;
5. prints where every output is.

Usage: ``python examples/demo.py [--out demo_out] [--epochs 12] [--workers 2] [--seed 0]
[--skip-dask] [--min-accuracy 0.9]``.
Runs in well under 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SIZE = 32
PROCESSED_SIZE = 64
TEST_FRACTION = 0.2
SHARD_SIZE = 360  # samples per shard: 4 train shards, 1 test shard

BIN = Path(sys.executable).parent  # the installed command-line tools
HERE = Path(__file__).resolve().parent


def banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(3, 74 - len(title)), flush=True)


# ---------------------------------------------------------------------------------------------
# 1. make shards
# ---------------------------------------------------------------------------------------------


def digit_image(pixels: np.ndarray, size: int = IMAGE_SIZE) -> Image.Image:
    """An 8x8 digit (values 0..16) as a size x size grayscale PIL image."""
    arr = (pixels.reshape(8, 8) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(arr).resize((size, size), Image.Resampling.BICUBIC)


def write_shards(out: Path, seed: int) -> dict:
    from sklearn.datasets import load_digits

    from tarshards import ShardWriter

    digits = load_digits()
    n = len(digits.target)
    order = np.random.default_rng(seed).permutation(n)
    ntest = int(round(n * TEST_FRACTION))
    splits = {"test": order[:ntest], "train": order[ntest:]}
    shard_dir = out / "shards"
    if shard_dir.exists():
        shutil.rmtree(shard_dir)
    shard_dir.mkdir(parents=True)
    written = {}
    for split, indices in splits.items():
        pattern = str(shard_dir / f"digits-{split}-%06d.tar")
        with ShardWriter(pattern, maxcount=SHARD_SIZE) as sink:
            for i in indices:
                label = int(digits.target[i])
                sink.write(
                    {
                        "__key__": f"digit{i:05d}",
                        "png": digit_image(digits.data[i]),  # encoded as PNG by extension
                        "cls": label,  # encoded as "7"
                        "json": {
                            "index": int(i),
                            "label": label,
                            "split": split,
                            "source": "sklearn.datasets.load_digits",
                        },
                    }
                )
        written[split] = [info.url for info in sink.shards]
        print(
            f"{split}: {len(indices)} samples in {len(sink.shards)} shards "
            f"({', '.join(Path(u).name for u in written[split])})"
        )
    return written


def brace_spec(urls: list[str]) -> str:
    """``digits-train-{000000..000003}.tar`` for consecutive shard names written by ShardWriter."""
    if len(urls) == 1:
        return urls[0]
    first, last = urls[0], urls[-1]
    head = first[: -len("000000.tar")]
    return f"{head}{{{first[-10:-4]}..{last[-10:-4]}}}.tar"


# ---------------------------------------------------------------------------------------------
# 2. inspect with the CLI tools
# ---------------------------------------------------------------------------------------------


def run_tool(args: list[str], *, show: int = 40) -> subprocess.CompletedProcess | None:
    """Run one installed tool from the virtual environment; print its output (shortened)."""
    exe = BIN / args[0]
    print(f"$ {' '.join([args[0]] + args[1:])}")
    if not exe.exists():
        print(f"  !! {args[0]} is not installed in {BIN} (pip install -e . installs it): SKIPPED")
        return None
    proc = subprocess.run([str(exe)] + args[1:], capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).rstrip("\n").splitlines()
    for line in lines[:show]:
        print(f"  {line}")
    if show and len(lines) > show:
        print(f"  ... ({len(lines) - show} more lines)")
    if proc.returncode != 0:
        print(f"  !! {args[0]} exited with status {proc.returncode}")
    return proc


def inspect_shards(out: Path, written: dict) -> dict:
    results = {}
    first = written["train"][0]
    run_tool(["tarshow", "-c", "2", first])
    run_tool(["tar2tsv", "-f", "cls json", "-c", "5", first])
    proc = run_tool(["tarcheck"] + written["train"] + written["test"], show=20)
    results["tarcheck"] = None if proc is None else proc.returncode
    sheet = out / "contact_sheet.png"
    if sheet.exists():
        sheet.unlink()
    proc = run_tool(["tarshow", "-c", "48", "--images", str(sheet), first], show=0)
    if proc is not None and proc.returncode == 0 and sheet.exists():
        with Image.open(sheet) as img:
            print(f"contact sheet: {sheet} ({img.size[0]}x{img.size[1]})")
        results["sheet"] = sheet
    else:
        print("!! contact sheet was not written")
        results["sheet"] = None
    return results


# ---------------------------------------------------------------------------------------------
# 3. train a CNN, streaming the shards
# ---------------------------------------------------------------------------------------------


MAX_DEGREES = 12.0
MAX_SHIFT = 3


def augment(img: Image.Image):
    """Small random rotations (+-12 degrees) and shifts (+-3 pixels), with PIL, then a tensor."""
    import random

    angle = random.uniform(-MAX_DEGREES, MAX_DEGREES)
    dx = random.randint(-MAX_SHIFT, MAX_SHIFT)
    dy = random.randint(-MAX_SHIFT, MAX_SHIFT)
    img = img.rotate(angle, resample=Image.Resampling.BILINEAR, translate=(dx, dy))
    return to_tensor(img)


def to_tensor(img: Image.Image):
    """A grayscale PIL image -> float tensor 1xHxW, normalized around 0."""
    import torch

    arr = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(arr - 0.5).unsqueeze(0)


def make_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16x16
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(256, 10),
    )


def _worker_init(worker_id: int) -> None:
    import random

    import torch

    torch.set_num_threads(1)
    random.seed(torch.initial_seed() % 2**32)  # different augmentations in each worker


def train(written: dict, *, epochs: int, workers: int, seed: int, batch_size: int = 64) -> dict:
    import torch
    import torch.nn.functional as F

    from tarshards import WebDataset, WebLoader

    torch.manual_seed(seed)
    train_spec = brace_spec(written["train"])
    test_spec = brace_spec(written["test"])
    trainset = (
        WebDataset(train_spec, shardshuffle=True, seed=seed)
        .shuffle(500)
        .decode("pill")  # PNG -> grayscale PIL image, cls -> int
        .to_tuple("png", "cls")
        .map_tuple(augment, None)
        .batched(batch_size)  # batch in the workers; the loader passes batches on
    )
    testset = (
        WebDataset(test_spec)
        .decode("pill")
        .to_tuple("png", "cls")
        .map_tuple(to_tensor, None)
        .batched(256)
    )
    print(f"train: {trainset!r}")
    print(f"test:  {testset!r}")
    loader = WebLoader(
        trainset,
        batch_size=None,
        num_workers=workers,
        worker_init_fn=_worker_init if workers else None,
    )
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    accuracy = 0.0
    history = []
    for epoch in range(epochs):
        model.train()
        t0 = time.perf_counter()
        total_loss, seen = 0.0, 0
        for images, labels in loader:
            labels = torch.as_tensor(labels)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.item() * len(labels)
            seen += len(labels)
        elapsed = time.perf_counter() - t0
        sched.step()
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for images, labels in testset:
                pred = model(images).argmax(1)
                correct += int((pred == torch.as_tensor(labels)).sum())
                count += len(labels)
        accuracy = correct / count
        history.append(
            {
                "epoch": epoch + 1,
                "loss": total_loss / seen,
                "accuracy": accuracy,
                "samples": seen,
                "samples_per_s": seen / elapsed,
            }
        )
        print(
            f"epoch {epoch + 1}/{epochs}: loss {total_loss / seen:.4f}  test accuracy "
            f"{100 * accuracy:.1f}% ({correct}/{count})  {seen} samples in {elapsed:.1f}s = "
            f"{seen / elapsed:.0f} samples/s",
            flush=True,
        )
    return {"accuracy": accuracy, "history": history, "model": model}


# ---------------------------------------------------------------------------------------------
# 4. process the shards in parallel
# ---------------------------------------------------------------------------------------------


def upscale_sample(sample: dict) -> dict:
    """Resize a sample's image to 64x64 (runs in worker processes, local or on a Dask cluster).

    ``map_shards(..., decode="pil")`` hands it decoded samples (PIL image, int, dict); the result
    is encoded again by extension when it is written.
    """
    out = dict(sample)
    out["png"] = sample["png"].resize((PROCESSED_SIZE, PROCESSED_SIZE), Image.Resampling.BICUBIC)
    return out


def process(written: dict, out: Path, engine: str, workers: int) -> dict:
    try:
        from tarshards.parallel import format_summary, map_shards
    except ImportError as exn:
        print(f"!! tarshards.parallel.map_shards is not available ({exn}): SKIPPED")
        return {"ok": False, "dir": None}
    inputs = written["train"] + written["test"]
    dest = out / f"processed-{engine}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    outputs = [str(dest / Path(u).name) for u in inputs]
    t0 = time.perf_counter()
    try:
        reports = map_shards(
            upscale_sample,
            inputs,
            outputs,
            engine=engine,
            workers=workers,
            decode="pil",
            progress=False,
        )
    except Exception as exn:  # show the failure, go on with the rest of the demo
        print(f"!! map_shards(engine={engine!r}) failed: {type(exn).__name__}: {exn}")
        return {"ok": False, "dir": dest}
    elapsed = time.perf_counter() - t0
    print(
        f"map_shards(upscale_sample, {len(inputs)} shards, engine={engine!r}, "
        f"workers={workers}): {elapsed:.1f}s"
    )
    print(format_summary(reports, elapsed))
    failed = [r for r in reports if r.status == "failed"]
    for r in failed:
        print(f"  !! {r.input}: {r.error}")
    ok = not failed and verify_processed(outputs)
    return {"ok": ok, "dir": dest, "seconds": elapsed}


def process_cli(written: dict, out: Path, workers: int) -> dict:
    """The same job from the shell: ``tarshards map -f demo:upscale_sample --engine dask``."""
    inputs = written["train"] + written["test"]
    dest = out / "processed-cli-dask"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    outputs = [str(dest / Path(u).name) for u in inputs]
    exe = BIN / "tarshards"
    in_spec = "::".join([brace_spec(written["train"]), brace_spec(written["test"])])
    out_spec = "::".join(str(dest / Path(brace_spec(written[s])).name) for s in ("train", "test"))
    args = [
        "map",
        "-f",
        "demo:upscale_sample",
        "--decode",
        "pil",
        "--engine",
        "dask",
        "-p",
        str(workers),
        in_spec,
        "-o",
        out_spec,
    ]
    print(
        f"$ PYTHONPATH={HERE} tarshards map -f demo:upscale_sample --decode pil --engine dask "
        f"-p {workers} '{in_spec}' -o '{out_spec}'"
    )
    if not exe.exists():
        print(f"  !! tarshards is not installed in {BIN}: SKIPPED")
        return {"ok": False, "dir": None}
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    t0 = time.perf_counter()
    proc = subprocess.run([str(exe)] + args, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - t0
    for line in (proc.stdout + proc.stderr).rstrip().splitlines()[-12:]:
        print(f"  {line}")
    if proc.returncode != 0:
        print(f"  !! tarshards map exited with status {proc.returncode}")
        return {"ok": False, "dir": dest}
    print(f"  {elapsed:.1f}s")
    return {"ok": verify_processed(outputs), "dir": dest, "seconds": elapsed}


def verify_processed(outputs: list[str]) -> bool:
    from tarshards import WebDataset

    missing = [o for o in outputs if not os.path.exists(o)]
    if missing:
        print(f"  !! missing outputs: {missing}")
        return False
    ds = WebDataset(outputs).decode("pill").to_tuple("png", "cls")
    n = 0
    sizes = set()
    for img, _ in ds:
        sizes.add(img.size)
        n += 1
    print(f"  verified {n} samples in {len(outputs)} output shards, image sizes {sorted(sizes)}")
    return sizes == {(PROCESSED_SIZE, PROCESSED_SIZE)} and n > 0


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="demo_out", help="output directory (default demo_out)")
    parser.add_argument("--epochs", type=int, default=12, help="training epochs (default 12)")
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="DataLoader workers and parallel processes (default 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--skip-dask", action="store_true", help="skip the Dask steps")
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.90,
        help="fail below this test accuracy (default 0.90)",
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # the 2 DataLoader workers use the other cores
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    start = time.perf_counter()

    banner("1. scikit-learn digits -> tar shards (ShardWriter)")
    t0 = time.perf_counter()
    written = write_shards(out, args.seed)
    timings["shards"] = time.perf_counter() - t0

    banner("2. inspect with tarshow, tar2tsv, tarcheck; contact sheet")
    t0 = time.perf_counter()
    inspected = inspect_shards(out, written)
    timings["inspect"] = time.perf_counter() - t0

    banner("3. train a CNN, streaming the shards (WebDataset + 2-worker WebLoader)")
    t0 = time.perf_counter()
    trained = train(written, epochs=args.epochs, workers=args.workers, seed=args.seed)
    timings["train"] = time.perf_counter() - t0
    model_path = out / "digits_cnn.pt"
    torch.save(trained["model"].state_dict(), model_path)
    print(
        f"ACCURACY: {100 * trained['accuracy']:.1f}% on the test shards after {args.epochs} "
        f"epochs (target >= 90%)"
    )

    banner("4a. map_shards: resize to 64x64 on local processes")
    t0 = time.perf_counter()
    local = process(written, out, "processes", args.workers)
    timings["map processes"] = time.perf_counter() - t0

    if args.skip_dask:
        dask = cli = {"ok": None, "dir": None}
    else:
        banner("4b. map_shards: the same on a local Dask cluster")
        t0 = time.perf_counter()
        dask = process(written, out, "dask", args.workers)
        timings["map dask"] = time.perf_counter() - t0
        banner("4c. the same from the shell: tarshards map --engine dask")
        t0 = time.perf_counter()
        cli = process_cli(written, out, args.workers)
        timings["tarshards map dask"] = time.perf_counter() - t0

    timings["total"] = time.perf_counter() - start
    (out / "summary.json").write_text(
        json.dumps(
            {
                "accuracy": trained["accuracy"],
                "history": trained["history"],
                "timings_s": {k: round(v, 2) for k, v in timings.items()},
                "shards": written,
            },
            indent=2,
        )
    )

    banner("outputs")
    print(f"train shards:        {brace_spec(written['train'])}")
    print(f"test shards:         {brace_spec(written['test'])}")
    print(f"contact sheet:       {inspected['sheet'] or 'NOT WRITTEN'}")
    print(f"trained model:       {model_path}")
    print(f"processed (local):   {local['dir'] if local['ok'] else 'FAILED / SKIPPED'}")
    if dask["ok"] is not None:
        print(f"processed (dask):    {dask['dir'] if dask['ok'] else 'FAILED / SKIPPED'}")
    if cli["ok"] is not None:
        print(f"processed (CLI):     {cli['dir'] if cli['ok'] else 'FAILED / SKIPPED'}")
    print(f"summary:             {out / 'summary.json'}")
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))

    problems = []
    if trained["accuracy"] < args.min_accuracy:
        problems.append(
            f"test accuracy {100 * trained['accuracy']:.1f}% < {100 * args.min_accuracy:.0f}%"
        )
    if inspected.get("tarcheck") not in (0,):
        problems.append("tarcheck did not pass")
    if inspected["sheet"] is None:
        problems.append("no contact sheet")
    if not local["ok"]:
        problems.append("map_shards(engine='processes') did not complete")
    if dask["ok"] is False:
        problems.append("map_shards(engine='dask') did not complete")
    if cli["ok"] is False:
        problems.append("tarshards map --engine dask did not complete")
    if problems:
        print("DEMO FAILED: " + "; ".join(problems))
        return 1
    print("DEMO OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
