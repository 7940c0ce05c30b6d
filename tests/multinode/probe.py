"""Where each rank runs, as one JSON line per rank (no torch: quick to start).

``python tests/multinode/probe.py [SECONDS]``: after the report, wait SECONDS in a
barrier-free sleep (for the fault tests), then a final allreduce.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from mpi4py import MPI

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
total = world.allreduce(world.Get_rank())
print(json.dumps({"rank": world.Get_rank(), "size": world.Get_size(),
                  "host": socket.gethostname(), "processor": MPI.Get_processor_name(),
                  "local_rank": node.Get_rank(), "local_size": node.Get_size(),
                  "sum": total, "slurm_nnodes": os.environ.get("SLURM_NNODES"),
                  "slurm_nodelist": os.environ.get("SLURM_NODELIST")}), flush=True)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
    world.allreduce(1)
node.Free()
