"""torchrun's rendezvous arguments from a SLURM allocation: one ``torchrun`` per node, started by
``srun --ntasks-per-node=1``, each deriving the same endpoint from the same ``SLURM_*`` variables.
Pure: the environment is an argument (a unit test passes a fake one)::

    SLURM_JOB_NUM_NODES=2  SLURM_NODEID=1  SLURM_JOB_NODELIST=gpu[07-08]  SLURM_JOB_ID=4242
    SLURM_GPUS_ON_NODE=8
      -> torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-backend c10d
                  --rdzv-endpoint gpu07:29500 --rdzv-id 4242

The endpoint is the first host of the node list (SLURM's compressed form: ``gpu[07-08,11],cpu3``);
the port is ``MASTER_PORT`` or 29500; the processes per node are the node's GPUs
(``SLURM_GPUS_ON_NODE``, else ``SLURM_GPUS_PER_NODE`` such as ``h100:8``), else
``SLURM_NTASKS_PER_NODE``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    """One node's torchrun arguments (:meth:`argv`)."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    endpoint: str
    run_id: str

    def argv(self) -> list[str]:
        """``["--nnodes", "2", ..., "--rdzv-id", "4242"]`` for ``torchrun``."""
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--nproc-per-node",
                str(self.nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-08,11],cpu3"`` -> ``"gpu07"`` (zero padding
    kept). Raises ValueError for an empty or malformed list."""
    text = nodelist.strip()
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", text)
    if not text or m is None:
        raise ValueError(f"SLURM node list {nodelist!r} is empty or malformed")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    if not first.isdigit():
        raise ValueError(f"SLURM node list {nodelist!r}: {first!r} is not a node number")
    return prefix + first + suffix


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        m = re.search(r"(\d+)(?:\(x\d+\))?$", value.strip())  # "8", "h100:8", "8(x2)"
        if m:
            return int(m.group(1))
    return None


def rendezvous(env: Mapping[str, str], *, nproc_per_node: int | None = None) -> Rendezvous:
    """This node's torchrun rendezvous from ``env`` (``os.environ`` inside an ``srun`` step; module
    doc). ``nproc_per_node`` overrides what the allocation says. Raises ValueError naming the
    missing variable when ``env`` is not a SLURM job step."""
    missing = [n for n in ("SLURM_JOB_ID", "SLURM_NODEID") if n not in env]
    if "SLURM_JOB_NODELIST" not in env and "SLURM_NODELIST" not in env:
        missing.append("SLURM_JOB_NODELIST")
    if missing:
        raise ValueError(f"not inside a SLURM job step ({', '.join(missing)} unset): run it under srun")
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if nnodes is None:
        raise ValueError("SLURM_JOB_NUM_NODES / SLURM_NNODES unset: run it under srun")
    nproc = nproc_per_node or _int(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if nproc is None:
        raise ValueError("the allocation names no GPUs per node (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE): "
                         "pass nproc_per_node or allocate with --gpus-per-node")
    node_rank = int(env["SLURM_NODEID"])
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is not a node of the {nnodes}-node job")
    host = first_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
    port = int(env.get("MASTER_PORT") or DEFAULT_PORT)
    return Rendezvous(nnodes, node_rank, nproc, f"{host}:{port}", env["SLURM_JOB_ID"])
