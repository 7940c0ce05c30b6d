"""Does SPD-KFAC's overlap make progress during backward? (issue 4)

Measures, at the current world size, the time ``step()`` spends completing the factor
reductions (``FactorPipeline.finish``) and the whole iteration, for:
  no-overlap      factors reduced in step() (one fused reduce-scatter)
  overlap+test    buckets posted from the hooks; every hook tests the requests in flight
  overlap-notest  buckets posted from the hooks; no test calls (MPI progresses only in wait)
Run: launch/local -n 4 python benchmarks/overlap_progress.py [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model


def measure(comm: Communicator, mode: str, steps: int, batch: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10, in_channels=3, image_size=32)
    pre = KFACPreconditioner(model, comm=comm, overlap=mode != "no-overlap",
                             bucket_cap_mb=1.0, inv_update_steps=1000)
    averager = GradientAverager(model, comm)
    finish_times: list[float] = []
    if pre.pipeline is not None:
        original = pre.pipeline.finish

        def timed_finish(pieces):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = original(pieces)
            finish_times.append(time.perf_counter() - t)
            return out

        pre.pipeline.finish = timed_finish  # type: ignore[method-assign]
        if mode == "overlap-notest":
            pre.pipeline.progress = lambda: None  # type: ignore[method-assign]
    iters = []
    g = torch.Generator().manual_seed(comm.rank)
    for i in range(steps + 2):
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        comm.barrier()
        t = time.perf_counter()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        averager.synchronize()
        pre.step()
        if i >= 2:
            iters.append(time.perf_counter() - t)
    finish = statistics.median(finish_times[2:]) if finish_times else float("nan")
    return statistics.median(iters), finish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = Communicator()
    rows = []
    for _ in range(2):  # two rounds, modes interleaved
        for mode in ("no-overlap", "overlap+test", "overlap-notest"):
            rows.append((mode, *measure(comm, mode, args.steps, args.batch)))
    if comm.rank == 0:
        print(f"ResNet-20, {comm.size} ranks, batch {args.batch}/rank, factors every step, "
              f"medians of {args.steps} iterations, two interleaved rounds")
        print(f"{'mode':<16} {'iteration ms':>13} {'finish() ms':>12}")
        for mode, it, fin in rows:
            print(f"{mode:<16} {1e3 * it:>13.1f} {1e3 * fin:>12.2f}")


if __name__ == "__main__":
    main()
