"""``seqpar env``: the installed versions against the tested set, and the feature report."""

from __future__ import annotations

import importlib.metadata

from seqpar import compat
from seqpar.cli.env import PackageRow, package_rows
from seqpar.cli.main import main
from seqpar.compat import CHECKED_ON


def test_tested_set_pins_the_packages_seqpar_reaches_into() -> None:
    tested = compat.tested_set()
    for name in ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "pytest", "ruff"):
        assert name in tested, name
    for name, versions in CHECKED_ON.items():
        assert tested[name] in versions, name  # the shims' checked-on versions include the tested set's


def test_status_tells_tested_from_untested() -> None:
    assert PackageRow("torch", "2.13.0+cpu", "2.13.0").status == "tested"
    assert PackageRow("transformers", "5.26.0", "5.25.0").status == "untested (tested: 5.25.0)"
    assert PackageRow("peft", None, "0.21.2").status == "not installed"
    assert PackageRow("mamba-ssm", None, None).status == "-"
    assert PackageRow("kernels", "1.0", None).status == "not in the tested set"


def test_rows_read_the_installed_versions() -> None:
    rows = {r.name: r for r in package_rows()}
    assert rows["torch"].installed == importlib.metadata.version("torch")
    assert rows["transformers"].tested == compat.tested_set()["transformers"]


def test_env_prints_versions_and_features(capsys) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"transformers           {importlib.metadata.version('transformers')}" in out
    assert "state passing: Qwen3NextGatedDeltaNet" in out
    assert "features (" in out
    for dim in ("dp x sp (ulysses, ring, hybrid)", "N-D mesh (dp_replicate x dp_shard x sp x tp)", "tp", "ep (mesh)",
                "accelerate ParallelismConfig"):
        assert f"ok  parallelism: {dim}:" in out, dim  # every dimension is available with the tested set
