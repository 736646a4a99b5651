"""``seqpar env``: what is installed here against the tested set, and which features that leaves
available (as ``accelerate env`` and DeepSpeed's ``ds_report`` do). Paste it into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.compat import tested_set

PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "tokenizers", "safetensors",
            "huggingface-hub", "kernels", "numpy", "tqdm", "matplotlib", "flash-linear-attention",
            "mamba-ssm", "causal-conv1d", "flash-attn")
"""The packages whose versions matter to seqpar (the optional kernels last: absent is fine)."""


@dataclass(frozen=True)
class PackageRow:
    """One package: the version installed here (None: not installed) and the tested set's (None: not in it)."""

    name: str
    installed: str | None
    tested: str | None

    @property
    def status(self) -> str:
        if self.installed is None:
            return "not installed" if self.tested else "-"
        if self.tested is None:
            return "not in the tested set"
        local = self.installed.split("+", 1)[0]  # torch's "+cpu" / "+cu128" build tag
        return "tested" if local == self.tested else f"untested (tested: {self.tested})"


def package_rows() -> list[PackageRow]:
    """Every package of :data:`PACKAGES`, installed vs tested."""
    tested = tested_set()
    rows = []
    for name in PACKAGES:
        try:
            installed: str | None = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        rows.append(PackageRow(name, installed, tested.get(name)))
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions against the tested set, devices, and which features are available",
                       description=__doc__)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from seqpar.integrations.hf.features import feature_report

    print(f"seqpar {importlib.metadata.version('seqpar')} ({__file__.rsplit('/cli/', 1)[0]})")
    print(f"python {platform.python_version()} on {platform.platform()}")
    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)" if torch.version.cuda else "CPU build"
    backends = ", ".join(b for b in ("gloo", "nccl") if getattr(dist, f"is_{b}_available")())
    print(f"torch build: {cuda}; distributed backends: {backends or 'none'}; threads {torch.get_num_threads()}")
    print("\npackage                 installed          status")
    for row in package_rows():
        print(f"  {row.name:22s} {row.installed or '-':18s} {row.status}")
    report = feature_report()
    missing = [f for f in report if not f.available]
    print(f"\nfeatures ({len(report) - len(missing)} of {len(report)} available here)")
    for f in report:
        print(f"  {'ok ' if f.available else 'OFF'} {f.feature}: {f.detail}")
    sys.stdout.flush()
    return 0
