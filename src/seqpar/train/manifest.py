"""What a checkpoint holds, file by file: sizes and CRC-32s written at save, checked before a resume.

Every rank lists the files it wrote into the checkpoint (its ``.distcp`` shards and RNG state; rank
0 also DCP's ``.metadata``, ``trainer.pt``, the model config and the tokenizer) in its own
``manifest_rank<r>.json``, with each file's size and CRC-32 read back after writing. Before a run
resumes, :func:`damage` reads them all: a file that is missing, shorter or longer (truncated, or
written over), or whose bytes changed (corrupt) is named -- instead of a failure deep inside
``torch.distributed.checkpoint`` at load time, or a silently wrong model. Pure file work, no process
group: the parent of a local job (or every torchrun rank) runs it before any worker starts.
"""

from __future__ import annotations

import glob
import json
import os
import zlib

MANIFEST = "manifest_rank{rank}.json"
_CHUNK = 1 << 22


def crc32(path: str) -> int:
    """The CRC-32 of a file's bytes, read in 4 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(root: str, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of the files ``names`` (relative to ``root``)."""
    return {n: [os.path.getsize(os.path.join(root, n)), crc32(os.path.join(root, n))] for n in sorted(names)}


def files_of_rank(root: str, rank: int, extra: list[str] = ()) -> list[str]:
    """The files rank ``rank`` wrote into ``root``: DCP's ``__<rank>_<i>.distcp`` shards, its RNG state,
    and ``extra`` (rank 0's metadata files); every file under an ``extra`` directory counts."""
    names = [os.path.basename(p) for p in glob.glob(os.path.join(root, f"__{rank}_*.distcp"))]
    names.append(f"rng_rank{rank}.pt")
    for e in extra:
        full = os.path.join(root, e)
        if os.path.isdir(full):
            names += [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(full) for f in fs]
        elif os.path.isfile(full):
            names.append(e)
    return names


def write_manifest(root: str, rank: int, names: list[str]) -> None:
    """Rank ``rank``'s manifest of ``names`` in ``root`` (written to a temporary name, then renamed)."""
    path = os.path.join(root, MANIFEST.format(rank=rank))
    with open(path + ".part", "w") as f:
        json.dump({"rank": rank, "files": describe_files(root, names)}, f)
    os.replace(path + ".part", path)


def damage(root: str, world: int | None) -> list[str]:
    """What is wrong with the checkpoint in ``root``, one line per damaged file (empty: intact).
    ``world``: the ranks that saved it (each left a manifest); None: as many as manifests found.
    A checkpoint without any manifest (written before seqpar kept them) cannot be checked: []."""
    manifests = sorted(glob.glob(os.path.join(root, MANIFEST.format(rank="*"))))
    if not manifests:
        return []
    problems = []
    if world is not None:
        have = {os.path.basename(m) for m in manifests}
        problems += [f"{MANIFEST.format(rank=r)}: missing (rank {r}'s list of its files)" for r in range(world)
                     if MANIFEST.format(rank=r) not in have]
    for m in manifests:
        try:
            with open(m) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{os.path.basename(m)}: unreadable ({type(e).__name__}: {e})")
            continue
        for name, (size, crc) in files.items():
            path = os.path.join(root, name)
            if not os.path.isfile(path):
                problems.append(f"{name}: missing")
                continue
            have_size = os.path.getsize(path)
            if have_size != size:
                what = "truncated" if have_size < size else "longer than written"
                problems.append(f"{name}: {have_size} bytes, {size} written ({what})")
            elif crc32(path) != crc:
                problems.append(f"{name}: corrupt (its CRC-32 differs from the one written)")
    return problems
