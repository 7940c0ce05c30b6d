"""``kfac-hpc ckpt inspect PATH`` and ``kfac-hpc ckpt verify PATH`` (no MPI launch needed).

``inspect`` reads everything from the file: step, world size, strategy, versions,
config, model/optimizer sizes, every K-FAC layer with its factor shapes, update
counts and owners at save time, RNG and ``extra``. ``verify`` checks the format,
manifest, attribute digest and every dataset's checksums, and that the training state
holds no NaN/Inf; exit status 0 when every checked file is sound, 1 otherwise. A
directory means its latest checkpoint (``--all``: every checkpoint in it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfac_hpc.checkpoint.atomic import latest, list_checkpoints
from kfac_hpc.checkpoint.errors import CheckpointError
from kfac_hpc.checkpoint.layout import KFAC, MODEL, OPTIMIZER, RNG, TRAIN
from kfac_hpc.checkpoint.verify import (
    FileInfo,
    describe,
    open_checkpoint,
    read_header,
    verify_file,
)
from kfac_hpc.units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``inspect`` and ``verify`` actions to the ``kfac-hpc ckpt`` parser.

    Args:
        parser: The ``ckpt`` command's parser.
    """
    sub = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="what a checkpoint holds (layers, factor shapes, owners)",
                       description="Show what a checkpoint holds, read from the file.")
    p.add_argument("path", help="checkpoint file, or directory (its latest checkpoint)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    v = sub.add_parser("verify", help="check format, checksums, NaN/Inf (exit 0 ok, 1 bad)",
                       description="Check a checkpoint's format, manifest and checksums, and "
                       "that its model, optimizer and K-FAC state hold no NaN/Inf.")
    v.add_argument("path", help="checkpoint file, or directory (its latest checkpoint)")
    v.add_argument("--all", action="store_true", help="a directory: verify every checkpoint")
    v.add_argument("--no-data", action="store_true",
                   help="structure and metadata only (do not read the datasets)")
    v.add_argument("-q", "--quiet", action="store_true", help="print nothing; exit status only")


def _files(path: str, every: bool) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        if every:
            return list_checkpoints(p)
        found = latest(p)
        return [found] if found is not None else []
    return [p]


def summarize(info: FileInfo, file_bytes: int) -> dict[str, Any]:
    """Describe a checkpoint from its header only.

    Args:
        info: The file's header (:func:`~kfac_hpc.checkpoint.verify.read_header`).
        file_bytes: The file's size.

    Returns:
        A JSON-able description: step, world size, versions, bytes per section, the
        model and optimizer classes, K-FAC factors by layer, RNG and ``extra``.
    """
    root = info.root
    sizes: dict[str, list[int]] = {}
    for p, m in info.manifest.items():
        section = p.split("/")[1]
        n = 1
        for d in m["shape"]:
            n *= int(d)
        import numpy as np

        s = sizes.setdefault(section, [0, 0])
        s[0] += 1
        s[1] += n * np.dtype(m["dtype"]).itemsize
    out: dict[str, Any] = {
        "path": info.path, "file_bytes": file_bytes, "format_version": root.get("format_version"),
        "step": root.get("step"), "world_size": root.get("world_size"),
        "strategy": root.get("strategy"), "created_utc": root.get("created_utc"),
        "versions": json.loads(root.get("versions", "{}")),
        "config": json.loads(root.get("config", "{}")),
        "sections": {k: {"datasets": v[0], "bytes": v[1]} for k, v in sorted(sizes.items())},
    }
    model = info.group(MODEL)
    if model is not None:
        out["model"] = {"class": model.get("class"),
                        "tensors": len(json.loads(model.get("names", "[]")))}
    opt = info.group(OPTIMIZER)
    if opt is not None:
        out["optimizer"] = {"class": opt.get("class"), "layout": opt.get("layout")}
    kfac = info.group(KFAC)
    if kfac is not None:
        table = json.loads(kfac["factors"])
        layers: dict[str, dict[str, Any]] = {}
        for key, f in table.items():
            layer, _, which = key.rpartition("/")
            layers.setdefault(layer or key, {})[which or key] = {
                "shape": f["shape"], "updates": f["updates"], "owner": f["owner"],
                "stored": f["stored"]}
        out["kfac"] = {"step": kfac.get("step"), "world_size": kfac.get("world_size"),
                       "strategy": kfac.get("strategy"), "eigenbases": bool(kfac.get("eigenbases")),
                       "layers": layers}
    rng = info.group(RNG)
    if rng is not None:
        out["rng"] = {"ranks": rng.get("world_size"), "identical": bool(rng.get("identical"))}
    train = info.group(TRAIN)
    if train is not None:
        structure = json.loads(train["structure"])
        top = {}
        for k, node in structure.get("dict", []):
            (kind, value), = node.items()
            top[str(k)] = value if kind == "value" else f"<{kind}>"
        out["extra"] = top
    return out


def _factor_cell(f: dict[str, Any]) -> str:
    """A factor's shape for the table, ``*`` marking one not stored (``-``: absent)."""
    shape = "x".join(str(d) for d in f.get("shape", [])) or "-"
    return shape + ("" if f.get("stored", False) else "*")


def _print_summary(s: dict[str, Any], problems: Sequence[str]) -> None:
    print(f"{s['path']}  ({format_bytes(s['file_bytes'])}, format version {s['format_version']})")
    print(f"  step {s['step']}  world size {s['world_size']}  strategy {s['strategy']}  "
          f"created {s['created_utc']}")
    v = s["versions"]
    print("  written by " + ", ".join(f"{k} {v[k]}" for k in
                                      ("kfac_hpc", "torch", "h5py", "hdf5", "mpi4py") if k in v))
    if v.get("mpi_library"):
        print(f"  MPI: {v['mpi_library']}")
    for name, sec in s["sections"].items():
        print(f"  /{name:<10} {sec['datasets']:>6} datasets  {format_bytes(sec['bytes']):>10}")
    if "model" in s:
        print(f"  model: {s['model']['class']}, {s['model']['tensors']} tensors")
    if "optimizer" in s:
        print(f"  optimizer: {s['optimizer']['class']} ({s['optimizer']['layout']} layout)")
    if "kfac" in s:
        k = s["kfac"]
        print(f"  K-FAC: step {k['step']}, {len(k['layers'])} layers, saved on "
              f"{k['world_size']} ranks, strategy {k['strategy']}, eigenbases "
              f"{'stored' if k['eigenbases'] else 'not stored (recomputed on load)'}")
        width = max([5, *(len(n) for n in k["layers"])])
        print(f"    {'layer':<{width}}  {'A':>12}  {'G':>12}  {'updates':>8}  owners(A,G)")
        for name, fs in k["layers"].items():
            a, g = fs.get("A", {}), fs.get("G", {})
            print(f"    {name:<{width}}  {_factor_cell(a):>12}  {_factor_cell(g):>12}  "
                  f"{a.get('updates', '-'):>8}  {a.get('owner', '-')},{g.get('owner', '-')}")
        if any(not f.get("stored", True) for fs in k["layers"].values() for f in fs.values()):
            print("    (* not stored: no update yet)")
    if "rng" in s:
        print(f"  RNG: {s['rng']['ranks']} rank(s), "
              f"{'identical on all ranks' if s['rng']['identical'] else 'per-rank states'}")
    if "extra" in s:
        print(f"  extra: {json.dumps(s['extra'], default=str)}")
    if s["config"]:
        print(f"  config: {json.dumps(s['config'], sort_keys=True)}")
    for p in problems:
        print(f"  PROBLEM: {p}")


def _inspect(args: argparse.Namespace) -> int:
    files = _files(args.path, False)
    if not files:
        print(f"kfac-hpc ckpt: no checkpoint in {args.path}", file=sys.stderr)
        return 1
    path = files[0]
    try:
        with open_checkpoint(path) as f:
            info, problems = read_header(f, str(path))
        summary = summarize(info, os.path.getsize(path))
    except CheckpointError as exc:
        print(f"kfac-hpc ckpt: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # damaged bytes make h5py raise almost anything
        print(f"kfac-hpc ckpt: {path}: damaged HDF5 structure ({describe(exc)})",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**summary, "problems": problems}, indent=2, default=str))
    else:
        _print_summary(summary, problems)
    return 0


def _verify(args: argparse.Namespace) -> int:
    files = _files(args.path, args.all)
    if not files:
        if not args.quiet:
            print(f"kfac-hpc ckpt: no checkpoint in {args.path}", file=sys.stderr)
        return 1
    status = 0
    for path in files:
        report = verify_file(path, data=not args.no_data)
        if not report.ok:
            status = 1
        if args.quiet:
            continue
        if report.ok:
            what = "structure" if args.no_data else f"{report.datasets} datasets, " \
                f"{format_bytes(report.nbytes)} checked"
            print(f"OK    {path}  ({what})")
        else:
            print(f"BAD   {path}")
            for p in report.problems:
                print("      " + p.replace("\n", "\n      "))
    return status


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc ckpt inspect`` or ``kfac-hpc ckpt verify``.

    Args:
        args: The parsed arguments (:func:`add_arguments`).

    Returns:
        The exit status: 0 when every checkpoint named is fine, 1 otherwise.
    """
    if args.ckpt_command == "inspect":
        return _inspect(args)
    return _verify(args)
