"""Two hosts, rehearsed on one (issue 46, item 5): two torchrun agents (``--nnodes 2 --rdzv-backend c10d``,
2 ranks each) run ``seqpar train --sp 2``: each agent's two ranks form an sp group, dp crosses the agents.

- The losses, gradient norms and learning rates of every step, and the exported weights, equal the
  one-agent run's (``torchrun --nproc-per-node 4``, same options) bit for bit. Why bit for bit and
  not a bound: torchrun numbers the ranks the same way (each agent's ranks consecutive, checked
  here from every rank's environment), so every rank holds the same shard and runs the same gloo
  collectives, with the same algorithms, in the same order; which agent started a process and which
  store served the rendezvous change no arithmetic. A difference would be a bug, not rounding.
- One agent lost (SIGKILL of its process group; its workers die with it) in the middle of a step,
  after a checkpoint: the other agent's ranks stop with seqpar's RankFailed naming the lost ranks,
  said once, within seconds (the collective timeout is 120 s) -- and ``--resume auto`` on both
  agents continues from the last complete checkpoint and ends as the uninterrupted run ends.
- The agent that serves the job's store (rank 0's) lost: the other agent's ranks cannot read the
  store; they stop and say that the store's agent, with its ranks, is gone -- from the transport
  error they meet, or, when no rank is in a collective, from the SIGTERM their own agent sends.

The kill lands at a known point: a small launcher (written to the test's directory) makes the
ranks of one agent (by its torchrun group rank) wait at the start of a step, so the others wait for
them inside that step's collectives when the test kills that agent. The three runs are heavy (each
torchrun job starts 2 agents and 4 interpreters with torch and transformers: 40-60 s here under
load, 4-7 minutes in all): ``make verify``. The launcher's pure rules at the end of this file
and the liveness rules (tests/comm/test_liveness.py) run in ``make test``.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from seqpar.comm.liveness import Member
from seqpar.train.launcher import placement_warning, speaks_for_agent

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
STEPS, SAVE_EVERY, STALL_AT = 7, 2, 6  # the lost agent stalls in step 6: the last complete checkpoint is step 4
TIMEOUT = 120  # --timeout: the collective timeout the survivors must not wait for
JOB_S = 420  # seconds a torchrun job may take here (a loaded 2-core machine)

LAUNCHER = '''
import json, os, sys, time

out = os.environ["SEQPAR_TEST_DIR"]
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
path = os.path.join(out, "rank%s.json" % os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    json.dump({**{k: int(os.environ[k]) for k in keys}, "pid": os.getpid(), "agent_pid": os.getppid()}, f)
os.replace(path + ".tmp", path)  # the test reads it while the job runs: whole or not at all
stall = os.environ.get("SEQPAR_TEST_STALL_GROUP")
if stall == "all" or stall == os.environ["GROUP_RANK"]:
    from seqpar.train.step import StaticSteps
    real = StaticSteps.forward_backward

    def forward_backward(self, step):
        if step + 1 == int(os.environ["SEQPAR_TEST_STALL_AT"]):  # step: the steps done so far
            open(os.path.join(out, "stalled%s" % os.environ["RANK"]), "w").close()
            time.sleep(3600)
        return real(self, step)

    StaticSteps.forward_backward = forward_backward
from seqpar.cli.main import main
sys.exit(main(sys.argv[1:]))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    """The torchrun agents of one job, each in a process group of its own (its workers in theirs:
    torchrun starts each worker in a new session); :meth:`kill_all` leaves nothing behind."""

    def __init__(self, workdir, name):
        self.dir = workdir / name
        self.dir.mkdir()
        self.save_dir = self.dir / "run"
        self.agents: list[subprocess.Popen] = []
        self.pids: set[int] = set()
        (self.dir / "launch.py").write_text(LAUNCHER)

    def start(self, torchrun_args, train_args, env=None):
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "SEQPAR_TEST_DIR": str(self.dir),
               **(env or {})}
        i = len(self.agents)
        cmd = [TORCHRUN, *torchrun_args, str(self.dir / "launch.py"), "train", "--no-progress", "--no-plot",
               "--seq-len", "32", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--dtype", "float64",
               "--sp", "2", "--timeout", str(TIMEOUT), "--resume", "auto", "--export-hf", "--save-dir",
               str(self.save_dir), *train_args]
        with open(self.dir / f"agent{i}.out", "w") as out, open(self.dir / f"agent{i}.err", "w") as err:
            self.agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True))
        return self.agents[-1]

    def start_two(self, train_args=(), env=None):
        """Two agents on one rendezvous endpoint; the first binds it (it serves the rendezvous store)."""
        port = _free_port()
        rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", f"seqpar-test-{port}", "--monitor-interval", "0.5"]
        first = self.start([*rdzv, "--node-rank", "0"], train_args, env)
        deadline = time.monotonic() + 120
        while True:  # the second agent must find the first one's store, not start its own
            assert first.poll() is None and time.monotonic() < deadline, self.output(0)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        self.start([*rdzv, "--node-rank", "1"], train_args, env)

    def track(self):
        for a in self.agents:
            self.pids.update([a.pid, *_descendants(a.pid)])

    def wait(self, timeout=JOB_S):
        for a in self.agents:
            a.wait(timeout=timeout)

    def output(self, i):
        return (self.dir / f"agent{i}.out").read_text(), (self.dir / f"agent{i}.err").read_text()

    def ranks(self):
        """Every rank's environment as its launcher saw it (rank -> RANK, LOCAL_RANK, GROUP_RANK, ..., pid)."""
        out = {}
        for f in self.dir.glob("rank*.json"):
            r = json.loads(f.read_text())
            out[r["RANK"]] = r
        return out

    def kill_all(self):
        self.track()
        for pid in self.pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for a in self.agents:
            try:
                a.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def jobs(tmp_path):
    made: list[Job] = []

    def make(name):
        made.append(Job(tmp_path, name))
        return made[-1]

    yield make
    for job in made:  # on success and on failure alike: no agent or worker outlives the test
        job.kill_all()
    left = [p for job in made for p in job.pids if _alive(p)]
    assert not left, f"processes left behind: {left}"


def _run_two(job, train_args=()):
    job.start_two(train_args)
    job.wait()
    for i, a in enumerate(job.agents):
        assert a.returncode == 0, job.output(i)


def _steps(save_dir):
    """Each step's (loss, grad norm, lr) from metrics.jsonl (a resumed run's file holds every step)."""
    rows = [json.loads(line) for line in open(save_dir / "metrics.jsonl")]
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r and "grad_norm" in r}


def _weights(save_dir):
    from safetensors.torch import load_file

    out = {}
    for f in sorted((save_dir / "hf").glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, list((save_dir / "hf").iterdir())
    return out


def _same_run(a, b):
    got, want = _steps(a), _steps(b)
    assert sorted(want) == list(range(1, STEPS + 1)) and got == want, (got, want)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), \
        [k for k in wa if not torch.equal(wa[k], wb[k])]


def _agents_of(job):
    """rank -> the index of the agent (in job.agents) that started it; checks torchrun's numbering:
    each agent's ranks are consecutive, so every sp pair (2k, 2k + 1) sits in one agent."""
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    pids = [a.pid for a in job.agents]
    agent_of = {r: pids.index(v["agent_pid"]) for r, v in ranks.items()}
    for v in ranks.values():  # every agent runs 2: torchrun's rank = its group rank x 2 + its local rank
        assert v["RANK"] == v["GROUP_RANK"] * v["LOCAL_WORLD_SIZE"] + v["LOCAL_RANK"], v
    for k in (0, 2):
        assert agent_of[k] == agent_of[k + 1], agent_of  # sp groups never span agents
    assert agent_of[0] != agent_of[2], agent_of  # dp crosses them
    return agent_of


@pytest.mark.heavy
@pytest.mark.distributed
@needs_torchrun
def test_two_agents_train_as_one(jobs):
    two = jobs("two")
    _run_two(two)
    agent_of = _agents_of(two)
    rank0 = agent_of[0]
    out, err = two.output(rank0)
    assert out.count("seqpar train: 7 steps") == 1 and "sp=2 x dp=2" in out, out  # rank 0 reports, once
    assert "warning" not in err and "seqpar train: error" not in err, err
    other_out, other_err = two.output(1 - rank0)
    assert "seqpar train" not in other_out + other_err, other_out + other_err

    one = jobs("one")
    one.start(["--standalone", "--nproc-per-node", "4"], [])
    one.wait()
    assert one.agents[0].returncode == 0, one.output(0)
    _same_run(two.save_dir, one.save_dir)


def _kill_when_stalled(job, group, stalled="one"):
    """Wait until the ranks of torchrun group ``group`` stall (``stalled="all"``: every rank), then
    SIGKILL that agent's process group (its workers die with it); returns (the victim's ranks, the
    surviving agent, the kill's time)."""
    ranks = None
    deadline = time.monotonic() + JOB_S
    while ranks is None:
        assert all(a.poll() is None for a in job.agents) and time.monotonic() < deadline, \
            [job.output(i) for i in range(2)]
        found = job.ranks()
        waiting = [r for r, v in found.items() if stalled == "all" or v["GROUP_RANK"] == group]
        if len(found) == 4 and all((job.dir / f"stalled{r}").exists() for r in waiting):
            ranks = found
        time.sleep(0.2)
    job.track()
    pids = [a.pid for a in job.agents]
    victim = pids.index(next(v["agent_pid"] for v in ranks.values() if v["GROUP_RANK"] == group))
    lost = sorted(r for r, v in ranks.items() if v["GROUP_RANK"] == group)
    os.killpg(job.agents[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    workers = [ranks[r]["pid"] for r in lost]
    while any(_alive(p) for p in workers) and time.monotonic() < killed_at + 10:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), "the lost agent's workers outlived it"
    return lost, 1 - victim, killed_at


def _stopped_promptly(job, survivor, killed_at):
    job.agents[survivor].wait(timeout=TIMEOUT)  # a hang fails here, at the collective timeout
    took = time.monotonic() - killed_at
    assert job.agents[survivor].returncode != 0
    assert took < TIMEOUT / 3, f"took {took:.0f}s to stop"
    out, err = job.output(survivor)
    said = [line for line in err.splitlines() if line.startswith("seqpar train: error:")]
    assert len(said) == 1, err  # once for the agent, not once per rank
    assert not any(line.startswith("[rank") and "Traceback" in line for line in err.splitlines()), err
    return said[0], err


@pytest.mark.heavy
@pytest.mark.distributed
@needs_torchrun
def test_a_lost_agent_stops_the_other_and_the_run_resumes(jobs):
    plain = jobs("plain")
    _run_two(plain)

    killed = jobs("killed")
    killed.start_two(env={"SEQPAR_TEST_STALL_GROUP": "1", "SEQPAR_TEST_STALL_AT": str(STALL_AT)})
    lost, survivor, killed_at = _kill_when_stalled(killed, 1)
    said, err = _stopped_promptly(killed, survivor, killed_at)
    assert f"seqpar: ranks {lost[0]}, {lost[1]} (torchrun agent 1 on host" in said, said
    assert "are gone: their processes stopped beating in the job's store" in said, said
    last = killed.save_dir / "checkpoints" / f"step_{STALL_AT - SAVE_EVERY:08d}"
    assert f"last complete checkpoint: {last} (--resume auto continues from it)" in err, err

    resumed = jobs("resumed")  # the same save dir, both agents again
    resumed.save_dir = killed.save_dir
    _run_two(resumed)
    out = "".join(resumed.output(i)[0] for i in range(2))
    assert f"resumed     from step {STALL_AT - SAVE_EVERY} (" in out, out
    _same_run(killed.save_dir, plain.save_dir)


@pytest.mark.heavy
@pytest.mark.distributed
@needs_torchrun
@pytest.mark.parametrize("stalled", ["one", "all"])
def test_losing_the_store_host_stops_the_other_with_a_clear_message(jobs, stalled):
    """``one``: the survivors wait in a collective for the lost ranks and meet the transport error
    first. ``all``: every rank sleeps, outside any collective, so only the surviving agent notices
    (its rendezvous store is gone) and stops its workers with SIGTERM -- which says the cause."""
    job = jobs("store")
    job.start_two(env={"SEQPAR_TEST_STALL_GROUP": "0" if stalled == "one" else "all",
                       "SEQPAR_TEST_STALL_AT": str(STALL_AT)})
    lost, survivor, killed_at = _kill_when_stalled(job, 0, stalled)  # rank 0's agent serves the workers' store
    assert lost == [0, 1]
    said, _ = _stopped_promptly(job, survivor, killed_at)
    assert "the job's store does not answer" in said, said
    assert "so the torchrun agent that served it is gone, with ranks 0, 1 (torchrun agent 0 on host" in said, said
    if stalled == "all":
        assert "noticed when its torchrun agent stopped it (SIGTERM)" in said, said


# ------------------------------------------------------------------------------------------------
# the launcher's pure rules (make test)
# ------------------------------------------------------------------------------------------------

def _roster(per_agent):
    out = []
    for agent, n in enumerate(per_agent):
        out += [Member(len(out) + i, agent, i, f"h{agent}", 100 + len(out) + i) for i in range(n)]
    return out


def test_sp_groups_across_agents_are_warned_about():
    assert placement_warning(_roster((2, 2)), 2, "sp group") is None
    assert placement_warning(_roster((4, 4)), 4, "sp group") is None
    text = placement_warning(_roster((3, 3)), 2, "sp group")  # --nproc-per-node 3 at --sp 2
    assert text is not None and text.startswith("warning: 1 sp group spans more than one torchrun agent")
    assert "rank 2 (torchrun agent 0 on host h0); rank 3 (torchrun agent 1 on host h1)" in text
    assert "--nproc-per-node a multiple of 2" in text
    text = placement_warning(_roster((2, 2)), 4, "sp group")
    assert text is not None and "ranks 0, 1 (torchrun agent 0 on host h0); ranks 2, 3 (torchrun agent 1" in text


def test_one_rank_per_agent_speaks():
    # the agent of ranks 2, 3: rank 2 says it, unless rank 2 is a culprit (then rank 3)
    assert speaks_for_agent(2, 0, 2, {0, 1}) and not speaks_for_agent(3, 1, 2, {0, 1})
    assert not speaks_for_agent(2, 0, 2, {2}) and speaks_for_agent(3, 1, 2, {2})
    assert not speaks_for_agent(0, 0, 2, {0, 1}) and not speaks_for_agent(1, 1, 2, {0, 1})  # all lost: nobody
