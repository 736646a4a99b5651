"""The scans of the state-passing run mode (:mod:`.state_passing`), one per kernel kind. Each runs
the model's own scan function (a :class:`~seqpar.compat.KernelCall`) on a batch of pieces -- one piece
per row, ``[n, len, ...]`` -- and splits its result into what crosses ranks. Every scan here is
*linear in its initial state* ``S``::

    final state   = M . S + B        M: the pieces' transition, B: their final state from zero
    output        = out0 + Q(S)      out0: the output from zero, Q linear in S

so a piece's summary ``(M, B)`` is all the next piece needs, and the true output follows once the
prefix over the pieces (:mod:`.state_passing`) has given each piece its ``S``.

``DeltaRule`` -- Gated DeltaNet (``torch_chunk_gated_delta_rule``), Kimi delta attention
(``chunk_kimi_delta_attention``). State ``S [H, K, V]``, per step ``S <- a (I - b k k^T) S + b k v^T``
(``a`` a scalar per head, or per key channel for Kimi), ``o = S^T q``. The value columns of ``S``
never mix, so the kernel runs ONCE with ``K`` more value columns, all zero, whose initial state is
the identity: ``v' = [v | 0]``, ``S0' = [0 | I]``. Their final state is ``M [K, K]``, their output
``Q'`` (``q`` carried through the piece's transitions), and ``o = out0 + Q' S``. Kernel work grows
by ``(V + K) / V``; the kernel does all of it (fla's on a GPU, transformers' torch code on a CPU).
That widened call is checkpointed (:func:`torch.utils.checkpoint.checkpoint`, non-reentrant): the
forward keeps its inputs and ``Q'``, not the kernel's intermediates, which the backward recomputes
-- one more kernel forward per layer and step, the same kernel on the same inputs. Kept, the widened
kernel's intermediates would be ``(V + K) / V`` times the unsharded layer's for every value-width
tensor (transformers' torch code: the padded values, the triangular solve's result, each chunk's
corrected values and states), so that a rank at P = 4 held more than a quarter of P = 1's
activations; recomputed, the layer keeps less per token than it does unsharded.

``Mamba2`` -- SSD (``mamba2_chunk_scan``): state ``h [H, P, N]``, ``h <- exp(dt A) h + dt B x^T``,
``y = C^T h + D x``. The decay is one scalar per head and step, so one extra zero input column
whose initial state is all ones gives ``M`` (that column's final state); the output's share of
``S`` is the kernel again with zero input, ``D = None`` and initial state ``S`` (a second call,
after the states are known). Kernel work about 2x.

``Mamba`` -- S6 (``mamba_selective_scan``), Jamba and Zamba: state ``h [I, N]`` per inner channel,
``h <- exp(dt A) * h + dt B x``, ``y = (C . h + D x) * silu(z)``. Its kernel takes no initial
state (neither transformers' torch code nor mamba-ssm's ``selective_scan_fn``), so the model's
kernel runs the piece from zero (``out0``, ``B``) and seqpar computes the rest in torch from the
kernel's own inputs: ``cs = cumsum(softplus(dt + delta_bias))`` (the kernel's discretization),
``M = exp(A cs_end)``, ``Q(S)_t = (C_t . (exp(A cs_t) * S)) * silu(z_t)`` -- in time chunks,
recomputed in backward, so it holds ``O(I N)`` per chunk, not per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ...compat import KernelCall


@dataclass
class Local:
    """A batch of pieces scanned from a zero state: ``out0`` (the kernel's output layout,
    ``[n, ...]``), ``transition`` M and ``state`` B per piece (``[n, ...]``), ``aux`` for
    :meth:`StateScan.correct`."""

    out0: Tensor
    transition: Tensor
    state: Tensor
    aux: Any = None


class StateScan(Protocol):
    """How the state-passing mode runs one kind of scan (see the module doc)."""

    token_dims: Mapping[str, int]  # the arguments that hold tokens -> their token dim (dim 0: rows)
    out_dim: int  # the token dim of the output

    def local(self, call: KernelCall) -> Local: ...

    def combine(self, transition: Tensor, state: Tensor) -> Tensor:
        """``M . S`` for a batch of pieces."""
        ...

    def correct(self, call: KernelCall, local: Local, initial: Tensor) -> Tensor:
        """The pieces' output from the initial states ``initial`` (``[n, ...]`` like ``local.state``)."""
        ...

    def result(self, out: Tensor, call: KernelCall) -> Any:
        """What the kernel returns to the model for output ``out`` (without a final state)."""
        ...


def _state_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class DeltaRule:
    """Gated DeltaNet and Kimi delta attention (see the module doc)."""

    token_dims = {"query": 1, "key": 1, "value": 1, "g": 1, "beta": 1}
    out_dim = 1

    def local(self, call: KernelCall) -> Local:
        dv = call["value"].shape[-1]
        names = [name for name in self.token_dims if call[name] is not None]
        inputs = [call[name] for name in names]
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            # recomputed in backward: the kernel's intermediates are not kept (see the module doc)
            out, final = checkpoint(_widened, call, names, *inputs, use_reentrant=False)
        else:
            out, final = _widened(call, names, *inputs)
        # out [n, T, H, V + K] = [out0 | Q'];  final [n, H, K, V + K] = [B | M]. Q' kept as its own
        # tensor (the correction saves it for backward), so that `out` dies with the layer's forward
        return Local(out[..., :dv], final[..., dv:], final[..., :dv], aux=out[..., dv:].contiguous())

    def combine(self, transition: Tensor, state: Tensor) -> Tensor:
        return transition @ state  # [n, H, K, K] @ [n, H, K, V]

    def correct(self, call: KernelCall, local: Local, initial: Tensor) -> Tensor:
        q = local.aux.to(initial.dtype)  # [n, T, H, K]
        return local.out0 + torch.einsum("nthk,nhkv->nthv", q, initial).to(local.out0.dtype)

    def result(self, out: Tensor, call: KernelCall) -> Any:
        assert not call["output_final_state"], "a cached call does not run sequence-parallel"
        return out, None


def _widened(call: KernelCall, names: list[str], *inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel on ``inputs`` (the token arguments ``names``) with ``K`` more value columns, all
    zero, whose initial state is the identity: ``[out0 | Q']``, ``[B | M]``."""
    call = call.replace(**dict(zip(names, inputs, strict=True)))
    v = call["value"]  # [n, T, H, V]
    n, t, h, dv = v.shape
    dk = call["key"].shape[-1]
    wide = torch.cat([v, v.new_zeros(n, t, h, dk)], -1)  # [n, T, H, V + K]
    eye = torch.eye(dk, dtype=_state_dtype(v), device=v.device).expand(n, h, dk, dk)
    init = torch.cat([eye.new_zeros(n, h, dk, dv), eye], -1)  # [n, H, K, V + K]
    return call.replace(value=wide, initial_state=init, output_final_state=True)()


class Mamba2:
    """Mamba2's SSD scan (see the module doc)."""

    token_dims = {"hidden_states": 1, "dt": 1, "B": 1, "C": 1}
    out_dim = 1

    def local(self, call: KernelCall) -> Local:
        x = call["hidden_states"]  # [n, T, H, P]
        n, t, h, p = x.shape
        init = x.new_zeros(n, h, p + 1, call["B"].shape[-1], dtype=_state_dtype(x))  # [n, H, P + 1, N]
        init[:, :, p] = 1.0  # the extra column's state: its final value is the decay M
        out, final = call.replace(hidden_states=torch.cat([x, x.new_zeros(n, t, h, 1)], -1), initial_states=init,
                                  return_final_states=True)()
        return Local(out[..., :p], final[:, :, p, 0], final[:, :, :p])  # out0 [n, T, H, P], M [n, H], B

    def combine(self, transition: Tensor, state: Tensor) -> Tensor:
        return transition[..., None, None] * state  # [n, H] . [n, H, P, N]

    def correct(self, call: KernelCall, local: Local, initial: Tensor) -> Tensor:
        x = call["hidden_states"]
        carried = call.replace(hidden_states=torch.zeros_like(x), D=None, initial_states=initial,
                               return_final_states=False)()  # [n, T, H, P]: C^T (decay) S
        return local.out0 + carried.to(local.out0.dtype)

    def result(self, out: Tensor, call: KernelCall) -> Any:
        assert not call["return_final_states"], "a cached call does not run sequence-parallel"
        return out


class Mamba:
    """Mamba's S6 scan, whose kernel takes no initial state (see the module doc)."""

    token_dims = {"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2}
    out_dim = 2
    chunk_elements = 1 << 22  # per time chunk of the carried term: [n, I, chunk, N] at most this many

    def local(self, call: KernelCall) -> Local:
        out0, final = call.replace(return_last_state=True)()  # [n, I, T], [n, I, N]
        dtype = _state_dtype(final)
        dt = call["dt"]  # [n, I, T], before the kernel's discretization, which this repeats
        if call["delta_bias"] is not None:
            dt = dt + call["delta_bias"].to(dt.dtype)[..., None]
        if call["delta_softplus"]:
            dt = F.softplus(dt)
        cs = dt.to(dtype).cumsum(-1)  # [n, I, T]: the decay's exponent from the piece's start, over A
        a = call["A"].to(dtype)  # [I, N]
        return Local(out0, torch.exp(a * cs[..., -1:]), final.to(dtype), aux=cs)

    def combine(self, transition: Tensor, state: Tensor) -> Tensor:
        return transition * state  # [n, I, N]

    def correct(self, call: KernelCall, local: Local, initial: Tensor) -> Tensor:
        cs, c, z = local.aux, call["C"], call["z"]  # [n, I, T], [n, N, T], [n, I, T] or None
        a = call["A"].to(cs.dtype)
        n, i, t = cs.shape
        step = max(1, self.chunk_elements // max(1, n * i * a.shape[-1]))
        parts = [checkpoint(_carried, cs[..., s:s + step], c[..., s:s + step], a, initial, use_reentrant=False)
                 for s in range(0, t, step)]
        carried = torch.cat(parts, -1) if parts else cs.new_zeros(n, i, 0)  # [n, I, T]
        if z is not None:
            carried = carried * F.silu(z.to(carried.dtype))
        return local.out0 + carried.to(local.out0.dtype)

    def result(self, out: Tensor, call: KernelCall) -> Any:
        assert not call["return_last_state"], "a cached call does not run sequence-parallel"
        return out


def _carried(cs: Tensor, c: Tensor, a: Tensor, initial: Tensor) -> Tensor:
    """``sum_N C_t * exp(A cs_t) * S`` for one time chunk: ``cs [n, I, t]``, ``c [n, N, t]``,
    ``a [I, N]``, ``initial [n, I, N]`` -> ``[n, I, t]``."""
    decay = torch.exp(a[None, :, None, :] * cs[..., None])  # [n, I, t, N]
    return torch.einsum("nitk,nik,nkt->nit", decay, initial, c.to(cs.dtype))


DELTA_RULE, MAMBA2, MAMBA = DeltaRule(), Mamba2(), Mamba()
