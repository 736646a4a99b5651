"""Backend detection by what a group runs, not by equality with "nccl" (issue 14): a mixed
"cpu:gloo,cuda:nccl" group and a bare init_process_group() ("undefined", its config names NCCL)
must put the mesh, the trainer and every collective's tensors on CUDA."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm import collectives, mesh

CASES = [  # get_backend(), get_backend_config() -> NCCL?
    ("nccl", "cuda:nccl", True),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True),
    ("undefined", "cpu:gloo,cuda:nccl", True),  # bare init_process_group() on a CUDA build
    ("NCCL", "CUDA:NCCL", True),
    ("gloo", "cpu:gloo,cuda:gloo", False),
    ("undefined", "cpu:gloo", False),  # bare init_process_group() on a CPU build
]


@pytest.fixture
def backend(monkeypatch):
    def set_(name, config, cuda=True):
        monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return set_


@pytest.mark.parametrize("name,config,nccl", CASES)
def test_nccl_found_in_mixed_and_bare_backends(backend, name, config, nccl):
    backend(name, config)
    assert mesh.uses_nccl() is nccl
    assert mesh.default_device_type() == ("cuda" if nccl else "cpu")
    assert collectives.comm_device(None) == (torch.device("cuda", 3) if nccl else torch.device("cpu"))


def test_no_cuda_means_cpu_even_with_nccl_named(backend):
    backend("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", cuda=False)
    assert mesh.default_device_type() == "cpu"


def test_torch_without_backend_config(backend, monkeypatch):
    backend("nccl", "")
    monkeypatch.delattr(dist, "get_backend_config")
    assert mesh.uses_nccl() and mesh.backend_names() == "nccl"


def test_a_group_without_a_config_falls_back_to_its_backend(backend, monkeypatch):
    backend("undefined", "")

    def missing(group=None):
        raise ValueError("no config")

    monkeypatch.setattr(dist, "get_backend_config", missing)
    assert not mesh.uses_nccl() and mesh.backend_names() == "undefined"


def test_batch_devices_that_truly_conflict_are_refused():
    from seqpar.batch.validate import device_problem

    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert device_problem({cpu}, gpu0) is None  # a DataLoader batch with NCCL: metadata moves once
    assert device_problem({cpu}, cpu) is None and device_problem(set(), gpu0) is None
    assert device_problem({gpu0}, gpu0) is None
    assert "set_device" in device_problem({gpu1}, gpu0)
    assert "different devices (cpu, cuda:0)" in device_problem({cpu, gpu0}, gpu0)
