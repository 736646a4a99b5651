"""What a ``seqpar train`` run writes beside its checkpoints, all on rank 0, in ``--save-dir``:

    metrics.jsonl   one JSON line per step ({"step", "loss", "lr", "grad_norm", ...}) and one per
                    evaluation ({"step", "eval_loss", "eval_accuracy", "eval_targets"}; step 0 is the
                    evaluation before training); a resumed run drops the lines after its checkpoint
    tensorboard/    the same scalars (--report-to tensorboard): train/loss, train/lr, train/grad_norm,
                    train/tokens_per_s, eval/loss, eval/accuracy
    wandb/          the same through wandb (--report-to wandb): offline unless wandb is logged in
                    (WANDB_API_KEY or ``wandb login``) or WANDB_MODE says otherwise
    summary.json    the run's summary (:class:`seqpar.train.loop.RunSummary`)
    loss.png        the train loss per step and the eval loss at each evaluation (--plot)
    hf/             --export-hf: the model as save_pretrained output (seqpar.integrations.hf.export)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalResult:
    """Held-out loss per unit, the objective's accuracy (the task's answers, the preferred one of a
    pair; None for an objective without one: RL rollouts), and the units' count."""

    loss: float
    accuracy: float | None
    targets: int

METRICS_FILE, SUMMARY_FILE, PLOT_FILE = "metrics.jsonl", "summary.json", "loss.png"
TENSORBOARD_DIR, WANDB_DIR = "tensorboard", "wandb"
HF_DIR = "hf"  # --export-hf: save_pretrained output; a fresh run deletes it only with --overwrite
OUTPUTS = (METRICS_FILE, SUMMARY_FILE, PLOT_FILE, TENSORBOARD_DIR, WANDB_DIR)
"""Everything a fresh run replaces in its save dir (with the checkpoints and the export)."""


def truncate_metrics(path: str, step: int) -> None:
    """Keep the metric lines up to ``step`` (those after it are about to be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(keep)


def read_metrics(save_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train lines, eval lines)`` of a run's metrics.jsonl."""
    with open(os.path.join(save_dir, METRICS_FILE)) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [m for m in lines if "loss" in m], [m for m in lines if "eval_loss" in m]


def _wandb_mode() -> str:
    """online when wandb has credentials (or WANDB_MODE says so), else offline: no network needed."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class MetricsLog:
    """Rank 0's metric sinks: metrics.jsonl, and tensorboard or wandb (``--report-to``)."""

    def __init__(self, save_dir: str, report_to: str, *, resumed_step: int | None, config: dict[str, Any]) -> None:
        path = os.path.join(save_dir, METRICS_FILE)
        if resumed_step is not None:
            truncate_metrics(path, resumed_step)
        self.file = open(path, "a")  # noqa: SIM115 -- closed by close()
        self.tb: Any = None
        self.wandb: Any = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's events replace those the interrupted run wrote after its checkpoint
            self.tb = SummaryWriter(os.path.join(save_dir, TENSORBOARD_DIR),
                                    purge_step=None if resumed_step is None else resumed_step + 1)
        elif report_to == "wandb":
            import wandb

            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "seqpar"), dir=save_dir, config=config,
                                    name=os.path.basename(os.path.abspath(save_dir)), mode=_wandb_mode(),
                                    settings=wandb.Settings(quiet=True, console="off"))
            os.makedirs(os.path.join(save_dir, WANDB_DIR), exist_ok=True)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def train(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self._scalars(line["step"], {f"train/{k}": float(line[k]) for k in ("loss", "lr", "grad_norm", "tokens_per_s")})

    def eval(self, step: int, result: Any) -> None:
        if result is None:
            return
        self.file.write(json.dumps({"step": step, "eval_loss": result.loss, "eval_accuracy": result.accuracy,
                                    "eval_targets": result.targets}) + "\n")
        self.file.flush()
        self._scalars(step, {"eval/loss": result.loss,
                             **({"eval/accuracy": result.accuracy} if result.accuracy is not None else {})})

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_summary(save_dir: str, summary: Any) -> str:
    """summary.json: the run's summary dataclass as JSON. Returns its path."""
    path = os.path.join(save_dir, SUMMARY_FILE)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(summary), f, indent=1, default=str)
        f.write("\n")
    return path


def plot_losses(save_dir: str) -> str:
    """loss.png: the train loss per step and the eval loss at each evaluation, from metrics.jsonl
    (a resumed run's earlier steps included). Returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train, evals = read_metrics(save_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in train], [m["loss"] for m in train], label="train loss", lw=1)
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per target token")
    ax.set_title(f"seqpar train: {os.path.basename(os.path.abspath(save_dir))}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(save_dir, PLOT_FILE)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
