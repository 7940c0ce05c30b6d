"""Measured vs the planner's predicted collective times on nodes with a set link rate.

Run on nodes made by ``launch/netns-nodes`` with a rate limit on every node's link::

    launch/netns-nodes -N 4 -n 1 --qdisc "tbf rate 100mbit burst 64kb latency 400ms" \\
        python benchmarks/netns_collectives.py --mbit 100

Each rank sends through its own node's link, so β = 8 / (rate in bit/s) s/byte; α is
the measured time of an 8-byte allreduce divided by the planner's latency coefficient.
Prints a Markdown table (rank 0): collective, size, measured (median of the slowest
rank), predicted (:func:`kfac_hpc.plan.collectives.collective_time`, algorithm
``auto``), ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kfac_hpc.comm import Communicator
from kfac_hpc.plan.collectives import coefficients, collective_time


def timed(comm: Communicator, call: Callable[[], object], repeat: int) -> float:
    """Median over ``repeat`` calls of the slowest rank's time."""
    samples = []
    for _ in range(repeat):
        comm.barrier()
        start = time.perf_counter()
        call()
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        samples.append(float(comm.allreduce(mine, op="max").item()))
    return statistics.median(samples)


def collective_calls(comm: Communicator, data: torch.Tensor, counts: list[int]
                     ) -> dict[str, Callable[[], object]]:
    """One call per collective the cost model predicts, each on a fresh copy of ``data``."""
    return {
        "allreduce": lambda: comm.allreduce(data.clone()),
        "reduce_scatter": lambda: comm.reduce_scatter(data.clone(), counts),
        "broadcast": lambda: comm.broadcast(data.clone()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, required=True, help="each node's link rate")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = Communicator()
    p = comm.size
    beta = 8 / (args.mbit * 1e6)
    tiny = torch.zeros(2, dtype=torch.float32)
    t_small = timed(comm, lambda: comm.allreduce(tiny.clone()), 20)
    latency = coefficients("allreduce", p, "auto", 8, 1e-5, beta)[1].latency
    alpha = t_small / max(latency, 1)
    rows = []
    for kib in (64, 512, 4096):
        n = kib * 1024 // 4
        data = torch.ones(n, dtype=torch.float32)
        counts = [n // p] * (p - 1) + [n - (n // p) * (p - 1)]
        for kind, call in collective_calls(comm, data, counts).items():
            measured = timed(comm, call, args.repeat)
            predicted = collective_time(kind, n * 4, p, alpha, beta)
            rows.append((kind, kib, measured, predicted))
    if comm.rank == 0:
        print(f"{p} ranks, {args.mbit:g} Mbit/s per node link: beta = {beta:.3e} s/B, "
              f"alpha = {alpha * 1e6:.0f} us (8-byte allreduce {t_small * 1e6:.0f} us)")
        print("| collective | KiB | measured ms | predicted ms | measured / predicted |")
        print("| --- | --- | --- | --- | --- |")
        for kind, kib, measured, predicted in rows:
            print(f"| {kind} | {kib} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
                  f"{measured / predicted:.2f} |")


if __name__ == "__main__":
    main()
