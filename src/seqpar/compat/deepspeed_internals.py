"""DeepSpeed's private names seqpar touches: only the peer benchmark uses DeepSpeed, an optional
package (the table: :mod:`seqpar.compat`)."""

from __future__ import annotations

DEEPSPEED_SHM_OP = "deepspeed_shm_comm"


def deepspeed_skip_cpu_shm_build() -> None:
    """Before ``deepspeed.init_distributed`` on a CPU: mark DeepSpeed's shared-memory comm op as not
    buildable, so that its CPU backend does not JIT-compile it (one to four minutes of C++ on a fresh
    2-core machine). That op serves only ``inference_all_reduce``; every collective of training goes
    through torch.distributed (gloo) either way. Relies on ``deepspeed.ops.__compatible_ops__``, the
    cache of DeepSpeed's op probe (a dict its comm backend reads and, as its comment says, keeps edits
    to: checked on deepspeed 0.19.8)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False
