"""Input pipeline throughput: images/s per rank against DataLoader worker processes (issue 15).

    python benchmarks/loader.py                       # writes the RESULTS.md section
    python benchmarks/loader.py --workers 0 1 2 --ranks 1 2 --no-results

Two data sets, each through ``ShardedLoader`` exactly as ``kfac-hpc train`` feeds it:

* ``imagefolder``: JPEG files written once into ``--data`` (default
  ``benchmarks/out/loader-images``): ``--images`` images of random sizes around
  ImageNet's mean (about 400x350, quality 90), 10 classes; training transform
  (decode, random resized crop to 224, flip, normalise), batch 32 per rank,
  ``--loader-threads`` decoding threads per batch (1 by default, so that workers are
  the only parallelism);
* ``cifar``: 32x32 uint8 images in memory (CIFAR-10's size), pad-crop + flip +
  normalise, batch 128 per rank.

For ``--ranks P`` the P "ranks" are P concurrent processes (no MPI: the loader's
work needs none), each reading its shard of the same global order, as the ranks of
one node do; the table gives the mean images/s per rank and the node's total.
``--step-ms T``: the consumer waits T ms per batch, as the host of a GPU-bound
training step does; images/s then shows how much decoding the workers hide. Each
measurement is one pass over ``--batches`` batches after a warm-up batch (worker
start-up included in neither: it happens once per epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import OUT_DIR, format_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Input pipeline (issue 15)"


def make_images(root: Path, n: int) -> Path:
    """``n`` JPEGs under root/train/<class>/ (and a small val split), once."""
    import numpy as np
    from PIL import Image

    marker = root / f".complete-{n}"
    if marker.exists():
        return root
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("val", 20)):
        for i in range(count):
            d = root / split / f"c{i % 10}"
            d.mkdir(parents=True, exist_ok=True)
            h, w = int(rng.integers(300, 420)), int(rng.integers(340, 500))
            # smooth noise (JPEG-compressible like a photo, not white noise)
            small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
            img = Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)
            img.save(d / f"{i}.jpg", quality=90)
    marker.touch()
    return root


def measure(kind: str, workers: int, rank: int, ranks: int, batches: int, data: Path,
            loader_threads: int, step_ms: float = 0.0) -> dict[str, Any]:
    import torch

    from kfac_hpc.train.data import ShardedLoader, load_dataset

    torch.set_num_threads(1)
    if kind == "imagefolder":
        ds = load_dataset("imagefolder", path=data, augment=True, image_size=224,
                          num_threads=loader_threads).train
        batch = 32
    else:
        n = 128 * ranks * (batches + 1)
        x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8)
        from kfac_hpc.train.data import CIFAR10_MEAN, CIFAR10_STD, RandomCropFlip, TensorDataset

        ds = TensorDataset(x, torch.zeros(n, dtype=torch.long), scale=1 / 255,
                           mean=CIFAR10_MEAN, std=CIFAR10_STD,
                           augment=RandomCropFlip(seed=0, padding=4))
        batch = 128
    loader = ShardedLoader(ds, batch_size=batch, rank=rank, world_size=ranks, seed=0,
                           shuffle=True, num_workers=workers)
    it = iter(loader)
    next(it)  # warm-up: workers started, first batch through
    t0 = time.perf_counter()
    count = 0
    for _ in range(batches):
        x, _ = next(it)
        count += x.shape[0]
        if step_ms:
            time.sleep(step_ms / 1000)  # a GPU-bound training step: the host CPU waits
    dt = time.perf_counter() - t0
    del it
    return {"kind": kind, "workers": workers, "rank": rank, "ranks": ranks,
            "images": count, "seconds": dt, "images_per_s": count / dt}


def run_point(kind: str, workers: int, ranks: int, args: argparse.Namespace) -> float:
    """Mean images/s per rank of ``ranks`` concurrent processes."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", kind, str(workers), str(r), str(ranks),
         str(args.batches), str(args.data), str(args.loader_threads), str(args.step_ms)],
        stdout=subprocess.PIPE, text=True, env=env) for r in range(ranks)]
    rates = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode:
            raise SystemExit(f"worker failed ({p.returncode})")
        rates.append(float(json.loads(out.strip().splitlines()[-1])["images_per_s"]))
    return sum(rates) / len(rates)


def write_section(text: str) -> None:
    body = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION in body:
        start = body.index(SECTION)
        nxt = body.find("\n## ", start + len(SECTION))
        body = body[:start] + text + (body[nxt + 1:] if nxt >= 0 else "")
    else:
        body = body.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kinds", nargs="+", default=["imagefolder", "cifar"])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--loader-threads", type=int, default=1)
    ap.add_argument("--data", type=Path, default=OUT_DIR / "loader-images")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the consumer waits this long per batch (a GPU-bound training "
                         "step): shows how much decoding the workers hide behind it")
    ap.add_argument("--no-results", action="store_true", help="do not edit RESULTS.md")
    args = ap.parse_args()
    if args.worker:
        kind, w, r, p, b, data, threads, step_ms = args.worker
        print(json.dumps(measure(kind, int(w), int(r), int(p), int(b), Path(data),
                                 int(threads), float(step_ms))))
        return
    if "imagefolder" in args.kinds:
        make_images(args.data, args.images)
    load0 = os.getloadavg()[0]
    rows = []
    for kind in args.kinds:
        for ranks in args.ranks:
            for workers in args.workers:
                rate = run_point(kind, workers, ranks, args)
                rows.append([kind, ranks, workers, f"{rate:,.0f}", f"{rate * ranks:,.0f}"])
                print(rows[-1], flush=True)
    table = format_table(["data", "ranks on the node", "workers per rank", "images/s per rank",
                          "images/s (node)"], rows, markdown=True)
    print(table)
    load = " -> ".join(f"{v:.1f}" for v in (load0, os.getloadavg()[0]))
    if not args.no_results:
        write_section(f"{SECTION}\n\n`python benchmarks/loader.py {' '.join(sys.argv[1:])}`"
                      f" ({os.cpu_count()} cores, load average {load}; {args.batches} "
                      "batches per point, after one warm-up batch):\n\n"
                      f"{table}\n")


if __name__ == "__main__":
    main()
