"""Exact sequence parallelism for token mixers that are not attention: state-space (Mamba, Mamba2),
linear-attention (Gated DeltaNet) and short-convolution (LFM2) layers of hybrid models.

Each of these is causal and runs along the whole sequence (a convolution over time, a recurrence
or a chunked scan), so on a shard alone it would start from a zero state at every rank but the
first. seqpar wraps the model's own module (an instance ``forward`` that shadows the class's, the
class's own code and kernels still doing the work; :func:`unwrap_token_mixers` removes it) and
feeds it what it would see unsharded. Two approaches, chosen per call:

``"halo"`` (scalable) -- for a mixer that is per-token except for a causal convolution of width
``k`` (LFM2's short convolution): rank r receives the last ``k - 1`` inputs of rank r - 1
(:func:`seqpar.comm.halo.halo_exchange`; their gradient goes back in backward), runs the module on
``[halo, shard]`` and drops the halo's outputs. One point-to-point exchange each way per layer,
``k - 1`` tokens; the mixer's compute is not repeated. Contiguous layout with shards of at least
``k - 1`` tokens; otherwise the gather approach runs.

``"heads"`` (scalable compute) -- for Gated DeltaNet with Qwen3-Next's or Qwen3.5's projections,
Kimi delta attention, Mamba2 and Jamba's Mamba: every rank all-gathers the layer's input and runs
the model's own forward on the whole sequence for its share of the heads (Mamba: of the inner
channels) only -- a copy of the module whose projection rows, convolution channels, decays and
output-projection columns are views of the real parameters -- and the partial outputs are summed
over the ranks while each keeps its shard (:func:`seqpar.comm.gather.reduce_scatter_seq`). The
heads' work is independent up to the output projection, with two exceptions made exact across
ranks: a one-group Mamba2's gated norm spans all heads (its sum of squares is all-reduced,
:class:`_SplitGatedNorm`; with several groups whole groups split), and Mamba's ``x_proj`` reads
every channel to make dt, B, C (its product is all-reduced, :class:`_SummedLinear`). The compute
is split P ways (ranks past the last unit idle). Per layer: an all-gather and a reduce-scatter
each way::

    hidden_states      # [B, S/P, D]   this rank's shard
    gather_seq         # [B, S, D]     backward: reduce-scatter of the ranks' input gradients
    module on heads    # [B, S, D]     this rank's heads' share of out_proj (a partial sum)
    reduce_scatter_seq # [B, S/P, D]   the sum over ranks, this rank's shard; backward: all-gather

``"gather"`` (exact, not scalable) -- for the other recurrent mixers (Zamba's Mamba, Falcon-H1's
Mamba2, OLMo hybrid's and Bailing's delta rules) and where a split does not fit (biases, LoRA),
whose state would have to cross ranks inside the model's kernels: every rank all-gathers the
layer's input sequence, runs the module on the whole sequence, keeps its own slice; backward
reduce-scatters the input gradient. The mixer's compute is repeated on all P ranks and its input
is held whole for that layer (attention stays sharded)::

    hidden_states  # [B, S/P, D]  this rank's shard, layout order
    gather_seq     # [B, S, D]    layout order; backward: reduce-scatter (each rank used it all)
    original order (inverse layout permutation: zigzag and doc-zigzag work too)
    module.forward # [B, S, D']   the model's own code: whole rows with the padding mask, or each
                   #              packed document alone (its state starts at the document)
    layout order, this rank's slice   # [B, S/P, D']

Packed rows: each document runs alone, as the models' own varlen paths (``cu_seq_lens`` /
``seq_idx``) and seqpar's reference define packing. Padding: whole rows get the padding mask the
model's own mixer takes (halo: the padding mask of the window).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from ..attention.layout import inverse_permutation
from ..attention.shard import SeqShard, shard_cache
from ..batch.sharding import BATCH_KWARG, LocalBatch
from ..comm.collectives import split_offsets, split_sizes
from ..comm.gather import all_reduce_sum, gather_seq, reduce_scatter_seq
from ..comm.halo import halo_exchange
from ..comm.mesh import Axis, axis_group

GATHER, HALO, HEADS = "gather", "halo", "heads"

HANDLED_MIXERS: dict[str, str] = {
    # Gated DeltaNet: causal conv1d, then the chunked gated delta rule per head
    "Qwen3NextGatedDeltaNet": HEADS, "Qwen3_5GatedDeltaNet": HEADS, "Qwen3_5MoeGatedDeltaNet": HEADS,
    "OlmoHybridGatedDeltaNet": GATHER,
    # Kimi delta attention (per-channel decay): causal conv1d, then the chunked delta rule per head
    "KimiLinearDeltaAttention": HEADS, "BailingHybridDeltaAttention": GATHER,
    # Mamba2 (SSD): causal conv1d, then the chunked scan per head
    # (split by heads in whole groups when n_groups >= 2; gathered: Falcon-H1 (muP multipliers) and
    # Mamba2Mixer (only in attention-free models, which parallelize refuses))
    "BambaMixer": HEADS, "FalconH1Mixer": GATHER, "NemotronHMamba2Mixer": HEADS, "Zamba2MambaMixer": HEADS,
    "GraniteMoeHybridMambaLayer": HEADS, "Mamba2Mixer": GATHER,
    # Mamba (S6): causal conv1d, then the selective scan
    "JambaMambaMixer": HEADS, "ZambaMambaMixer": GATHER, "MambaMixer": GATHER, "FalconMambaMixer": GATHER,
    # LFM2: in_proj per token, a causal depthwise convolution of L_cache taps, out_proj per token
    "Lfm2ShortConv": HALO, "Lfm2MoeShortConv": HALO, "Lfm3ShortConv": HALO,
}
"""Token-mixer classes seqpar makes exact, and how. Each was read: its ``forward(hidden_states,
cache=None, attention_mask=None, **kwargs)`` is causal, treats batch rows independently, and takes
``kwargs`` only for packing metadata or kernels (dropped: seqpar runs documents apart)."""

_ATTR = "_seqpar_token_mixers"  # on the model: the wrapped modules, to unwrap


def mixer_approach(module: nn.Module) -> str | None:
    """``"gather"`` / ``"halo"`` for a token mixer seqpar handles (:data:`HANDLED_MIXERS`), else None."""
    return HANDLED_MIXERS.get(type(module).__name__)


def _halo_width(module: nn.Module) -> int:
    """``k - 1`` for the module's causal convolution of width ``k`` (LFM2: ``conv.kernel_size``)."""
    conv = getattr(module, "conv", None)
    return int(conv.kernel_size[0]) - 1 if isinstance(conv, nn.Conv1d) else -1


def token_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every handled token mixer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if mixer_approach(m) is not None]


def describe_token_mixers(model: nn.Module) -> str:
    """In words: which non-attention token mixers ``model`` has and how seqpar runs them ("" if none)."""
    counts: dict[tuple[str, str], int] = {}
    for _, m in token_mixers(model):
        key = (type(m).__name__, mixer_approach(m) or "")
        counts[key] = counts.get(key, 0) + 1
    how = {GATHER: "gathered: every rank runs the layer on the whole sequence (exact; its compute is repeated "
                   "P times and its input is held whole)",
           HALO: "halo: each rank runs its shard plus the previous rank's last kernel-1 inputs (exact, scalable; "
                 "gathered under a permuted layout)",
           HEADS: "split by heads: every rank runs the whole sequence for its share of the key heads and the "
                  "partial outputs are summed (exact; compute split P ways, input held whole)"}
    return "; ".join(f"{n} x{c} {how[a]}" for (n, a), c in sorted(counts.items()))


def _runs(shard: SeqShard) -> list[list[tuple[int, int]]] | None:
    """Per row, the ``(start, end)`` of each packed document's real tokens in original order, or
    None when no row is packed (whole rows run with the padding mask). Kept per batch."""
    if shard.segments is None:
        return None
    cache = shard_cache(shard)
    if "mixer runs" not in cache:
        seg, keep = shard.segments, shard.key_keep
        if shard.positions is not None:
            inv = inverse_permutation(shard.positions)
            seg = seg.index_select(1, inv)
            keep = None if keep is None else keep.index_select(1, inv)
        seg = seg.cpu().tolist()
        keep = None if keep is None else keep.cpu().tolist()
        rows = []
        for b, ids in enumerate(seg):
            runs: list[tuple[int, int]] = []
            for i, d in enumerate(ids):
                real = keep is None or keep[b][i]
                if real and runs and runs[-1][1] == i and ids[runs[-1][0]] == d:
                    runs[-1] = (runs[-1][0], i + 1)
                elif real:
                    runs.append((i, i + 1))
            rows.append(runs)
        cache["mixer runs"] = rows
    return cache["mixer runs"]


def _run_rows(forward: Callable[..., Tensor], x: Tensor, keep: Tensor | None,
              runs: list[list[tuple[int, int]]] | None) -> Tensor:
    """The module's own forward on ``x [B, W, D]`` (original order): whole rows with the padding
    mask ``keep [B, W]``, or, for packed rows, each document alone (zeros at padding)."""
    if runs is None:
        return _tensor(forward(x, attention_mask=None if keep is None else keep.to(torch.long)))
    rows = []
    for b, row_runs in enumerate(runs):
        pieces, pos = [], 0
        for a, e in row_runs:
            out = _tensor(forward(x[b:b + 1, a:e]))  # [1, e - a, D']
            if a > pos:
                pieces.append(out.new_zeros((1, a - pos, out.shape[-1])))
            pieces.append(out)
            pos = e
        rows.append(pieces)
    width = next((p.shape[-1] for pieces in rows for p in pieces), None)
    if width is None:  # nothing but padding: the outputs are never read, their shape still matters
        return _tensor(forward(x)) * 0
    full = []
    for pieces in rows:
        n = sum(p.shape[1] for p in pieces)
        if n < x.shape[1]:
            pieces.append(x.new_zeros((1, x.shape[1] - n, width)))
        full.append(torch.cat(pieces, dim=1))
    return torch.cat(full, dim=0)  # [B, W, D']


def _tensor(out: Any) -> Tensor:
    if not isinstance(out, Tensor):
        raise ValueError(f"seqpar expected a token mixer to return one tensor, got {type(out).__name__}")
    return out


def _gathered(forward: Callable[..., Tensor], x: Tensor, batch: LocalBatch, group: dist.ProcessGroup) -> Tensor:
    """The gather approach (see the module doc): ``x [B, S/P, D]`` -> ``[B, S/P, D']``."""
    shard = batch.shard
    whole = gather_seq(x, dim=1, group=group, sizes=shard.seq_lens)  # [B, S, D] layout order
    out = _in_order(forward, whole, shard)  # [B, S, D'] layout order
    start, n = shard.local_range(batch.sp_rank)
    return out.narrow(1, start, n)


def _shell(module: nn.Module, tensors: dict[str, Tensor | None], **attrs: Any) -> nn.Module:
    """A shallow copy of ``module`` (its class's code) whose named parameters are the given tensors
    -- views of the real parameters, so gradients reach them -- with ``attrs`` set; submodules not
    replaced are the real ones. No instance ``forward`` (seqpar's wrapper) is copied."""
    new = compat.module_shell(module)
    for name, t in tensors.items():
        object.__setattr__(new, name, t)
    for name, value in attrs.items():
        setattr(new, name, value)
    return new


def _rows(w: Tensor, *ranges: tuple[int, int]) -> Tensor:
    """``w``'s rows ``a .. e`` of each range, in order (a slice's copy; gradients reach ``w``)."""
    return torch.cat([w[a:e] for a, e in ranges])


def _gdn_heads(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """The Gated DeltaNet ``module`` restricted to key heads ``lo .. hi`` and their value heads
    (each key head serves ``r = num_v_heads / num_k_heads`` consecutive ones). Channels: the
    convolution runs over ``[q (nk*hk) | k (nk*hk) | v (nv*hv)]``; Qwen3-Next's ``in_proj_qkvz`` /
    ``in_proj_ba`` rows are grouped per key head, Qwen3.5's ``in_proj_qkv`` follows the convolution's
    channels and ``in_proj_z`` / ``_b`` / ``_a`` the value heads."""
    nk, nv, hk, hv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    r, n = nv // nk, hi - lo
    kd = nk * hk

    qkv = ((lo * hk, hi * hk), (kd + lo * hk, kd + hi * hk), (2 * kd + lo * r * hv, 2 * kd + hi * r * hv))
    conv = module.conv1d
    subs = {"conv1d": _shell(conv, {"weight": _rows(conv.weight, *qkv),
                                    "bias": None if conv.bias is None else _rows(conv.bias, *qkv)},
                             in_channels=2 * n * hk + n * r * hv, out_channels=2 * n * hk + n * r * hv,
                             groups=2 * n * hk + n * r * hv)}
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: [nk, 2 hk + 2 r hv] and [nk, 2 r] rows
        per, w = 2 * hk + 2 * r * hv, module.in_proj_qkvz.weight
        subs["in_proj_qkvz"] = _shell(module.in_proj_qkvz, {"weight": w[lo * per:hi * per], "bias": None})
        w = module.in_proj_ba.weight
        subs["in_proj_ba"] = _shell(module.in_proj_ba, {"weight": w[lo * 2 * r:hi * 2 * r], "bias": None})
    else:  # Qwen3.5
        subs["in_proj_qkv"] = _shell(module.in_proj_qkv, {"weight": _rows(module.in_proj_qkv.weight, *qkv),
                                                          "bias": None})
        for name, width in (("in_proj_z", hv), ("in_proj_b", 1), ("in_proj_a", 1)):
            lin = getattr(module, name)
            subs[name] = _shell(lin, {"weight": lin.weight[lo * r * width:hi * r * width], "bias": None})
    out = module.out_proj
    subs["out_proj"] = _shell(out, {"weight": out.weight[:, lo * r * hv:hi * r * hv], "bias": None})
    return _shell(module, {"dt_bias": module.dt_bias[lo * r:hi * r], "A_log": module.A_log[lo * r:hi * r]},
                  num_k_heads=n, num_v_heads=n * r, key_dim=n * hk, value_dim=n * r * hv,
                  conv_dim=2 * n * hk + n * r * hv, **subs)


def _mamba2_groups(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """The Mamba2 ``module`` restricted to groups ``lo .. hi`` (B and C are per group, the gated
    norm normalizes per group, so whole groups split exactly) and their heads. ``in_proj`` rows:
    ``[gate (I) | x (I) | B (G*N) | C (G*N) | dt (H)]``; the convolution runs over ``x | B | C``."""
    g, n_state, i_size = module.n_groups, module.ssm_state_size, module.intermediate_size
    per_group = module.num_heads // g
    n, width = hi - lo, (module.num_heads // g) * module.head_dim  # groups, channels of a group's heads
    x = (lo * width, hi * width)
    b = (i_size + lo * n_state, i_size + hi * n_state)
    c = (i_size + g * n_state + lo * n_state, i_size + g * n_state + hi * n_state)
    conv_dim = i_size + 2 * g * n_state

    conv, proj, out, norm = module.conv1d, module.in_proj, module.out_proj, module.norm
    sub_conv = n * width + 2 * n * n_state
    heads = (lo * per_group, hi * per_group)
    return _shell(
        module, {name: getattr(module, name)[heads[0]:heads[1]] for name in ("dt_bias", "A_log", "D")},
        num_heads=n * per_group, n_groups=n, intermediate_size=n * width, conv_dim=sub_conv,
        in_proj=_shell(proj, {"weight": _rows(proj.weight, x, *((i_size + a, i_size + e) for a, e in (x, b, c)),
                                             (i_size + conv_dim + heads[0], i_size + conv_dim + heads[1])),
                              "bias": None}),
        conv1d=_shell(conv, {"weight": _rows(conv.weight, x, b, c),
                             "bias": None if conv.bias is None else _rows(conv.bias, x, b, c)},
                      in_channels=sub_conv, out_channels=sub_conv, groups=sub_conv),
        norm=_shell(norm, {"weight": norm.weight[x[0]:x[1]]}),
        out_proj=_shell(out, {"weight": out.weight[:, x[0]:x[1]], "bias": None}))


def _kda_heads(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """Kimi delta attention restricted to heads ``lo .. hi``: q / k / v / b / gate rows and
    convolution channels ``[q | k | v]`` of those heads, their per-channel decays (the forget gate's
    ``f_b_proj`` rows, ``dt_bias``, ``A_log``) and ``o_proj`` columns. The low-rank ``f_a_proj`` /
    ``g_a_proj`` feed every head: each rank runs them whole (their gradients add up over ranks)."""
    d, dim = module.head_dim, module.qkv_dim
    ch = (lo * d, hi * d)

    def lin(m: nn.Linear) -> nn.Module:
        return _shell(m, {"weight": m.weight[ch[0]:ch[1]], "bias": None})

    conv, gate, out = module.conv1d, module.forget_gate, module.o_proj
    qkv = [(ch[0] + i * dim, ch[1] + i * dim) for i in range(3)]
    n = hi - lo
    return _shell(
        module, {}, num_heads=n, qkv_dim=n * d, conv_dim=3 * n * d,
        q_proj=lin(module.q_proj), k_proj=lin(module.k_proj), v_proj=lin(module.v_proj), g_b_proj=lin(module.g_b_proj),
        b_proj=_shell(module.b_proj, {"weight": module.b_proj.weight[lo:hi], "bias": None}),
        conv1d=_shell(conv, {"weight": _rows(conv.weight, *qkv), "bias": None},
                      in_channels=3 * n * d, out_channels=3 * n * d, groups=3 * n * d),
        forget_gate=_shell(gate, {"dt_bias": gate.dt_bias[ch[0]:ch[1]], "A_log": gate.A_log[:, :, lo:hi]},
                           num_heads=n, qkv_dim=n * d, f_b_proj=lin(gate.f_b_proj)),
        o_proj=_shell(out, {"weight": out.weight[:, ch[0]:ch[1]], "bias": None}))


_ONE_GROUP_SPLIT = {"BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer"}
"""Mamba2 mixers whose one-group case splits by heads: their gated norm is the same code (read and
tested), so :class:`_SplitGatedNorm` computes it."""


class _SplitGatedNorm(nn.Module):
    """The Mamba2 gated RMS norm (``x * silu(gate)``, normalized over the group, times ``weight``)
    of a group whose channels are spread over the ranks of ``group``: each rank holds its heads'
    channels and the group's mean square is the sum over ranks of the local sums of squares
    (:func:`seqpar.comm.gather.all_reduce_sum`: its backward all-reduces the gradient)."""

    def __init__(self, weight: Tensor, size: int, eps: float, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.size, self.variance_epsilon, self.group = weight, size, eps, group

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)  # [..., channels of this rank's heads]
        if gate is not None:
            h = h * nn.functional.silu(gate.to(torch.float32))
        square = all_reduce_sum(h.pow(2).sum(-1, keepdim=True), group=self.group)  # [..., 1], the whole group's
        h = h * torch.rsqrt(square / self.size + self.variance_epsilon)
        return self.weight * h.to(dtype)


def _mamba2_heads(module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
    """A one-group Mamba2 ``module`` restricted to heads ``lo .. hi``: B and C (one group, shared by
    every head) whole, the heads' gate / x channels, dt, dt_bias / A_log / D and out_proj columns,
    and the group's gated norm across the ranks (:class:`_SplitGatedNorm`). It runs as in eval
    (``training=False``): the fused training kernel would normalize over this rank's heads alone."""
    n_state, i_size, hd = module.ssm_state_size, module.intermediate_size, module.head_dim
    x, bc = (lo * hd, hi * hd), (i_size, i_size + 2 * n_state)
    conv_dim = i_size + 2 * n_state
    sub_conv = (hi - lo) * hd + 2 * n_state

    conv, proj, out, norm = module.conv1d, module.in_proj, module.out_proj, module.norm
    return _shell(
        module, {name: getattr(module, name)[lo:hi] for name in ("dt_bias", "A_log", "D")},
        num_heads=hi - lo, intermediate_size=(hi - lo) * hd, conv_dim=sub_conv, training=False,
        in_proj=_shell(proj, {"weight": _rows(proj.weight, x, (i_size + x[0], i_size + x[1]),
                                             (i_size + bc[0], i_size + bc[1]),
                                             (i_size + conv_dim + lo, i_size + conv_dim + hi)), "bias": None}),
        conv1d=_shell(conv, {"weight": _rows(conv.weight, x, bc),
                             "bias": None if conv.bias is None else _rows(conv.bias, x, bc)},
                      in_channels=sub_conv, out_channels=sub_conv, groups=sub_conv),
        norm=_SplitGatedNorm(norm.weight[x[0]:x[1]], i_size, norm.variance_epsilon, group),
        out_proj=_shell(out, {"weight": out.weight[:, x[0]:x[1]], "bias": None}))


class _SummedLinear(nn.Module):
    """``x [..., channels of this rank] @ weight[:, those channels]^T``, summed over ``group``: a
    linear layer over channels spread across ranks (:func:`seqpar.comm.gather.all_reduce_sum`)."""

    def __init__(self, weight: Tensor, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, x: Tensor) -> Tensor:
        return all_reduce_sum(nn.functional.linear(x, self.weight), group=self.group)


def _mamba_channels(module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
    """Jamba's Mamba (S6) restricted to inner channels ``lo .. hi``: the selective scan is per
    channel, but ``x_proj`` reads every channel to make dt, B and C -- its product over this
    rank's channels is summed across the ranks (:class:`_SummedLinear`), so each rank gets the
    whole dt, B, C (and runs the small dt / B / C norms on them). ``in_proj`` rows ``[x | z]``,
    convolution channels, ``dt_proj`` rows, ``A_log`` / ``D`` and ``out_proj`` columns are sliced."""
    i_size = module.intermediate_size
    conv, proj, dt, out = module.conv1d, module.in_proj, module.dt_proj, module.out_proj
    return _shell(
        module, {"A_log": module.A_log[lo:hi], "D": module.D[lo:hi]}, intermediate_size=hi - lo,
        in_proj=_shell(proj, {"weight": _rows(proj.weight, (lo, hi), (i_size + lo, i_size + hi)),
                              "bias": None}),
        conv1d=_shell(conv, {"weight": conv.weight[lo:hi], "bias": None if conv.bias is None else conv.bias[lo:hi]},
                      in_channels=hi - lo, out_channels=hi - lo, groups=hi - lo),
        x_proj=_SummedLinear(module.x_proj.weight[:, lo:hi], group),
        dt_proj=_shell(dt, {"weight": dt.weight[lo:hi], "bias": None if dt.bias is None else dt.bias[lo:hi]}),
        out_proj=_shell(out, {"weight": out.weight[:, lo:hi], "bias": None}))


def _split_kind(module: nn.Module) -> str:
    """Which slicer a split mixer takes: ``"gdn"`` (key heads), ``"kda"`` (heads), ``"mamba"``
    (inner channels) or ``"mamba2"`` (groups, or heads of its one group)."""
    if hasattr(module, "num_k_heads"):
        return "gdn"
    if hasattr(module, "forget_gate"):
        return "kda"
    return "mamba" if hasattr(module, "x_proj") else "mamba2"


def _head_units(module: nn.Module) -> int:
    """How many units the heads approach splits over the ranks."""
    kind = _split_kind(module)
    if kind == "gdn":
        return module.num_k_heads
    if kind == "mamba":
        return module.intermediate_size
    return module.num_heads if kind == "kda" or module.n_groups == 1 else module.n_groups


def _head_part(module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
    """The copy of ``module`` that computes units ``lo .. hi``."""
    kind = _split_kind(module)
    if kind == "gdn":
        return _gdn_heads(module, lo, hi)
    if kind == "kda":
        return _kda_heads(module, lo, hi)
    if kind == "mamba":
        return _mamba_channels(module, lo, hi, group)
    return _mamba2_heads(module, lo, hi, group) if module.n_groups == 1 else _mamba2_groups(module, lo, hi)


def _plain(*modules: nn.Module | None) -> bool:
    """Plain bias-free ``nn.Linear`` / ``nn.Conv1d`` (exactly those classes): what the slicers cut."""
    return all(type(m) in (nn.Linear, nn.Conv1d) and m.bias is None for m in modules)


def _heads_fit(module: nn.Module, p: int) -> bool:
    """Whether the split is exact for this module at ``p`` ranks: plain bias-free projections (a
    bias is not a per-unit partial sum; a wrapped layer, e.g. LoRA, is not sliced -- a convolution
    bias is sliced), and the shapes each slicer assumes; else the module runs gathered."""
    conv_ok = type(module.conv1d) is nn.Conv1d
    kind = _split_kind(module)
    if kind == "mamba":  # every rank some channels: x_proj's all-reduce needs them all
        return (conv_ok and _plain(module.in_proj, module.x_proj, module.out_proj)
                and type(module.dt_proj) is nn.Linear and module.intermediate_size >= p
                and tuple(module.A_log.shape) == (module.intermediate_size, module.ssm_state_size))
    if kind == "kda":
        gate = module.forget_gate
        return (_plain(module.conv1d, *(getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                                          "g_b_proj", "o_proj")),
                       getattr(gate, "f_b_proj", None))
                and tuple(getattr(gate, "A_log", torch.empty(0)).shape) == (1, 1, module.num_heads, 1))
    lins = [m for n, m in module.named_children() if n.startswith("in_proj") or n == "out_proj"]
    plain = conv_ok and _plain(*lins)
    if kind == "gdn":  # whole value-head groups per key head
        return (plain and module.num_v_heads % module.num_k_heads == 0
                and (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv")))
    # Mamba2: whole groups (two or more), or, with one group, every rank at least one head (the
    # norm's all-reduce needs every rank)
    g = module.n_groups
    one = g == 1 and type(module).__name__ in _ONE_GROUP_SPLIT and module.num_heads >= p
    return (plain and (g >= 2 or one) and module.num_heads % g == 0 and getattr(module.norm, "group_size", None)
            == module.intermediate_size // g and module.intermediate_size == module.num_heads * module.head_dim)


def _by_heads(module: nn.Module, x: Tensor, batch: LocalBatch, group: dist.ProcessGroup) -> Tensor:
    """The heads approach (see the module doc): ``x [B, S/P, D]`` -> ``[B, S/P, D]``."""
    shard = batch.shard
    whole = gather_seq(x, dim=1, group=group, sizes=shard.seq_lens)  # [B, S, D] layout order
    sizes = split_sizes(_head_units(module), batch.sp_size)
    lo = split_offsets(sizes)[batch.sp_rank]
    if sizes[batch.sp_rank] == 0:  # more ranks than units: nothing to compute, the collectives still run
        partial = whole * 0
    else:
        part = _head_part(module, lo, lo + sizes[batch.sp_rank], group)
        original = type(module).forward

        def own(h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
            return original(part, h, None, attention_mask)

        partial = _in_order(own, whole, shard)  # [B, S, D] this rank's heads' share
    return reduce_scatter_seq(partial, dim=1, group=group, sizes=shard.seq_lens)


def _in_order(forward: Callable[..., Tensor], whole: Tensor, shard: SeqShard) -> Tensor:
    """``forward`` on the whole sequence ``whole [B, S, D]`` (layout order) run in original order
    -- whole rows with the padding mask, or each packed document alone -- back in layout order."""
    perm, keep = shard.positions, shard.key_keep
    if perm is not None:
        inv = inverse_permutation(perm).to(whole.device)
        whole = whole.index_select(1, inv)  # original order
        keep = None if keep is None else keep.index_select(1, inv.to(keep.device))
    out = _run_rows(forward, whole, None if keep is None else keep.to(whole.device), _runs(shard))  # [B, S, D']
    return out if perm is None else out.index_select(1, perm.to(whole.device))


def _halo(forward: Callable[..., Tensor], x: Tensor, batch: LocalBatch, group: dist.ProcessGroup,
          width: int) -> Tensor:
    """The halo approach (see the module doc): ``x [B, S/P, D]`` -> ``[B, S/P, D']``."""
    shard = batch.shard
    start, n = shard.local_range(batch.sp_rank)
    halo = halo_exchange(x, width, dim=1, group=group)  # [B, h, D], h = width (0 on rank 0)
    h = halo.shape[1]
    window = torch.cat([halo, x], dim=1)  # [B, h + S/P, D] = tokens start - h .. start + n
    cols = slice(start - h, start + n)
    keep = None if shard.key_keep is None else shard.key_keep[:, cols].to(x.device)
    runs = _runs(shard)
    if runs is not None:  # the documents' pieces inside the window, in window coordinates
        runs = [[(max(a, start - h) - (start - h), min(e, start + n) - (start - h)) for a, e in row
                 if a < start + n and e > start - h] for row in runs]
    out = _run_rows(forward, window, keep, runs)  # [B, h + S/P, D']
    return out[:, h:]


def _halo_fits(batch: LocalBatch, width: int) -> bool:
    """The halo needs a contiguous layout and every shard (but the last) at least ``width`` long."""
    return batch.shard.positions is None and min(batch.shard.seq_lens[:-1], default=width) >= width


def wrap_token_mixers(model: nn.Module, mesh: DeviceMesh, last_batch: Callable[[], LocalBatch | None]) -> int:
    """Make every handled token mixer of ``model`` exact under sequence parallelism over the
    ``"sp"`` axis of ``mesh`` (in place; :func:`unwrap_token_mixers` undoes it). ``last_batch``
    returns the LocalBatch of the model's current call (caught by parallelize's pre-hook).
    Returns how many modules were wrapped."""
    group = axis_group(mesh, Axis.SP.value)
    forward = _sequence_parallel_forward(group, last_batch)
    wrapped = []
    for _, module in token_mixers(model):
        # a bound method: a deep copy of the model (an EMA or reference model) binds its own module
        module.forward = types.MethodType(forward, module)
        wrapped.append(module)
    setattr(model, _ATTR, wrapped)
    return len(wrapped)


def _sequence_parallel_forward(group: dist.ProcessGroup,
                               last_batch: Callable[[], LocalBatch | None]) -> Callable[..., Tensor]:
    """The ``forward`` seqpar binds to a handled token mixer (see the module doc)."""

    def forward(module: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        # hidden_states [B, S/P, D]: this rank's shard
        batch = kwargs.get(BATCH_KWARG) or last_batch()
        if not isinstance(batch, LocalBatch):
            raise ValueError("this model is sequence-parallel (seqpar.parallelize): feed it "
                             "model(**seqpar.shard_batch(batch, mesh)), or call seqpar.unparallelize(model)")
        if cache is not None:
            raise ValueError(f"{type(module).__name__} got a cache: sequence-parallel training runs with "
                             "use_cache=False (as shard_batch sets it)")
        if hidden_states.shape[1] != batch.local_len:
            raise ValueError(f"the batch was sharded with {batch.local_len} tokens on this rank, but "
                             f"{type(module).__name__} runs over {hidden_states.shape[1]}: shard the batch with the "
                             "mesh the model was parallelized with")
        batch.attention_calls += 1  # a layer that read the batch (the loss checks that some did)
        original = type(module).forward

        def own(x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
            return original(module, x, None, attention_mask)

        width = _halo_width(module)
        if mixer_approach(module) == HALO and width >= 0 and _halo_fits(batch, width):
            return _halo(own, hidden_states, batch, group, width)
        if mixer_approach(module) == HEADS and _heads_fit(module, batch.sp_size):
            return _by_heads(module, hidden_states, batch, group)
        return _gathered(own, hidden_states, batch, group)

    return forward


def unwrap_token_mixers(model: nn.Module) -> None:
    """Undo :func:`wrap_token_mixers` (nothing to do when it wrapped nothing)."""
    for module in getattr(model, _ATTR, ()):
        if "forward" in vars(module):
            del module.forward
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)
