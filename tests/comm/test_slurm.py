"""torchrun's rendezvous from SLURM variables (:mod:`seqpar.comm.slurm`), on fake environments: the
two nodes of one job derive the same endpoint and id and their own node rank."""

import pytest

from seqpar.comm.slurm import Rendezvous, first_host, rendezvous

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
       "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize("nodelist, host", [("gpu[07-08]", "gpu07"), ("gpu[007,011-012],cpu3", "gpu007"),
                                            ("node5,node6", "node5"), ("a[3]-ib", "a3-ib"), ("solo", "solo")])
def test_first_host_reads_compressed_lists(nodelist, host):
    assert first_host(nodelist) == host


def test_two_nodes_agree_on_the_endpoint_and_differ_in_rank():
    r0, r1 = (rendezvous({**JOB, "SLURM_NODEID": str(i)}) for i in (0, 1))
    assert r0 == Rendezvous(2, 0, 8, "gpu07:29500", "4242")
    assert (r1.endpoint, r1.run_id, r1.node_rank) == (r0.endpoint, r0.run_id, 1)
    assert r1.argv() == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "gpu07:29500", "--rdzv-id", "4242"]


def test_port_gpus_and_overrides():
    env = {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}
    r = rendezvous({**env, "SLURM_NODEID": "0", "SLURM_GPUS_PER_NODE": "h100:4", "MASTER_PORT": "31337"})
    assert (r.nproc_per_node, r.endpoint) == (4, "gpu07:31337")
    assert rendezvous({**JOB, "SLURM_NODEID": "0"}, nproc_per_node=2).nproc_per_node == 2
    old = {k.replace("JOB_NUM_NODES", "NNODES").replace("JOB_NODELIST", "NODELIST"): v for k, v in JOB.items()}
    assert rendezvous({**old, "SLURM_NODEID": "1"}).endpoint == "gpu07:29500"  # the older variable names


@pytest.mark.parametrize("env, message", [
    ({}, "not inside a SLURM job step"),
    ({**JOB, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node of the 2-node job"),
    ({**{k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}, "SLURM_NODEID": "0"}, "names no GPUs per node"),
    ({**JOB, "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[x-y]"}, "is not a node number"),
])
def test_bad_environments_say_what_is_missing(env, message):
    with pytest.raises(ValueError, match=message):
        rendezvous(env)
