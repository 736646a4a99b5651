"""The model zoo: every causal-LM class the installed transformers ships, tiny and in float64,
sequence-parallel against itself unsharded. Each family must end *exact* or *refused*.

Families are enumerated from transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (never
hand-picked). Each one's default config is shrunk by :func:`tiny_config` (hidden 32, 4 heads, 2 KV
heads, a few layers that still cover every ``layer_types`` kind, small MoE / MLA / window / chunk
sizes) and built in float64 with eager experts (transformers' grouped matmul has no float64).
Then, for each batch (padded rows, packed documents) and strategy, :func:`seqpar.testing.model_parity.
compare_models` runs the model with and without seqpar. Outcomes::

    exact        loss and every gradient within tolerance (model_parity's, float64)
    exact (float32 model)  the same, where the model computes some things in float32 itself
                 (measured: :func:`~seqpar.testing.model_parity.precision_floor`,
                 :func:`attention_floor`): those compared relative to float32 precision
    refused      parallelize (or the first sharded forward) raised :class:`seqpar.errors.Refused`
                 on every rank: a deliberate refusal
    mismatch     ran, but the loss or a gradient differs: silently wrong -- a bug
    crashed      any other exception, a ValueError that is not Refused included (an incidental
                 error of torch, transformers or seqpar is not a refusal) -- a bug
    unbuildable  transformers cannot build or run the family's tiny config without seqpar
                 (its own config validation or code); then the default config is built on the
                 meta device and parallelize must still refuse it or accept it (``refused`` /
                 ``accepted, not run``)

Hybrid families whose recurrent mixers run state passing (:mod:`seqpar.integrations.mixers.
state_passing`) run in that mode, with their scans in float64 (:mod:`.scans64`: transformers' torch
scans compute in float32 whatever the model's dtype, as its eager softmax does -- cf. :mod:`.eager64`)
for the reference and the sequence-parallel run alike.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from ..comm.agree import share
from ..errors import Refused
from ..integrations.hf.parallelize import parallelize, unparallelize
from ..integrations.mixers import STATE, family_of, token_mixers
from ..integrations.models import decoder_config
from .eager64 import register_eager_float64
from .model_parity import (
    GRAD_TOL,
    LOSS_TOL,
    Floor,
    ModelCase,
    case_batch,
    compare_models,
    precision_floor,
    reference_grads,
)
from .scans64 import float64_scans

TINY: dict[str, int | float] = dict(
    hidden_size=32, n_embd=32, d_model=32, embedding_size=32, attention_hidden_size=32,
    num_attention_heads=4, n_head=4, n_heads=4, decoder_attention_heads=4, num_heads=4,
    num_key_value_heads=2, head_dim=8, d_head=8, rotary_dim=4,
    intermediate_size=64, n_inner=64, ffn_dim=64, decoder_ffn_dim=64, ffn_hidden_size=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, num_experts_per_token=2, n_group=1, topk_group=1, num_expert_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, qk_head_dim=12,
    max_position_embeddings=256, n_positions=256, vocab_size=256, unpadded_vocab_size=256,
    vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
    index_head_dim=8, index_n_heads=2, index_topk=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=2, linear_num_heads=4, linear_head_dim=8,
    mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, state_size=8,
    mamba_expand=1, mamba_d_ssm=32, mamba_num_heads=4, mamba_head_dim=8, n_mamba_heads=4, mamba_headdim=8,
    n_groups=1, ssm_state_size=8,
    time_step_rank=4, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
    num_layers_per_stack=1, H_cycles=2, L_cycles=1,
    router_jitter_noise=0.0, sliding_window=5, sliding_window_size=5, attention_chunk_size=6,
    n_input_layers=2, n_output_layers=2, max_window_layers=1, moe_k=2,
    # single families' own widths, left at full size they made the zoo's largest models (LongCat-Flash
    # 69M parameters, XLM 102M, RoCBert 13M): more time than the other 200 families together
    expert_ffn_hidden_size=32, zero_expert_num=2, emb_dim=32, dff=64, dim_ff=64, lru_width=32, o_lora_rank=16,
    shape_vocab_size=256, shape_embed_dim=32, pronunciation_vocab_size=256, pronunciation_embed_dim=32,
    # MoE router aux losses on (SWITCHED_ON), weighted so that a wrong aux loss shows in the loss and gradients
    router_aux_loss_coef=0.1, aux_loss_coef=0.1, moe_loss_weight=0.1,
)
SWITCHED_ON = ("use_sliding_window", "output_router_logits")
"""Boolean config fields turned on, so the feature they gate is exercised."""
"""Config fields shrunk where a family's default config has them (windows and chunks only where set)."""

_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_OPTIONAL = ("sliding_window", "sliding_window_size", "attention_chunk_size", "hidden_size_per_layer_input")
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    # transformers' own default configs that do not build; the smallest change that makes them
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},  # default layer_types: None
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16]},  # its causal-LM head asserts is_decoder
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},  # its validator forbids the default
    # hybrids whose first attention layer comes after 3-5 linear-attention layers: one of each kind
    # (their torch-fallback scans are slow; every extra layer is the same mixer again)
    **{family: {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2}
       for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")},
    **{family: {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                "num_hidden_layers": 2} for family in ("kimi_linear", "bailing_hybrid")},
}
"""Config fields set before shrinking, for families whose default config does not build at all, or
whose shortest prefix with every layer kind is long (one layer of each kind keeps the zoo fast)."""

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 4 is refused for its NoPE temperature tuning; without it, its chunked layers must be exact
    "llama4_text/no-temperature-tuning": ("llama4_text", {"attn_temperature_tuning": False}),
    # LFM2's default config is all attention; its short-convolution layers must be refused
    "lfm2/conv-layers": ("lfm2", {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}),
    # hybrids whose default layer pattern has no attention layer within the first few: one Mamba
    # layer, then one attention layer
    "jamba/attention-layers": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1}),
    "bamba/attention-layers": ("bamba", {"attn_layer_indices": [1]}),
    "granitemoehybrid/attention-layers": ("granitemoehybrid", {"layer_types": ["mamba", "attention"]}),
    "zamba2/hybrid-layers": ("zamba2", {"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1],
                                                "attention_hidden_size": 64}),  # attention over [h, embeddings]
}
"""Families run a second time with a config switch that reaches a path the default does not."""

BATCHES = (("padded", 11), ("packed", 17))  # 3 padding tokens: fewer than any window, so no row of
# the reference sees only padding (transformers' float32 eager softmax turns such rows to NaN in float64)


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layers_needed(types: Any) -> int:
    """The shortest prefix of ``layer_types`` that has every kind in it (at least 2 layers)."""
    if not isinstance(types, list) or not types:
        return 2
    kinds = set(map(str, types))
    return next(max(2, i) for i in range(1, len(types) + 1) if set(map(str, types[:i])) == kinds)


def shrink_config(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict with :data:`TINY` sizes, per-layer lists cut to the layers kept, sub-configs shrunk."""
    out = dict(d)
    layers = next((d[k] for k in _LAYER_COUNTS if isinstance(d.get(k), int)), None)
    keep = _layers_needed(d.get("layer_types"))
    if "n_recurrent_layers" in d:  # Dory: input + recurrent + output blocks, counted in (attention, mlp) pairs
        keep = max(keep + keep % 2, 6)
    shared = d.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:  # layers that reuse earlier layers' K/V: keep a second copy
        keep, out["num_kv_shared_layers"] = 2 * keep, keep
    for key, val in d.items():
        if isinstance(val, dict) and val and all(str(k).isdigit() for k in val):  # per-layer settings
            out[key] = {k: shrink_config(v) if isinstance(v, dict) else v for k, v in val.items() if int(k) < keep}
        elif isinstance(val, dict) and ("model_type" in val or key.endswith("config")):
            out[key] = shrink_config(val)
        elif key in _LAYER_COUNTS and isinstance(val, int):
            out[key] = keep
        elif isinstance(val, list) and layers and len(val) == layers:
            out[key] = (val * 2)[:keep]
            if key in TINY and all(isinstance(x, int) and not isinstance(x, bool) for x in val):
                out[key] = [TINY[key]] * keep  # per-layer sizes (Gemma 3n's intermediate_size)
        elif key in TINY and isinstance(val, (int, float)) and not isinstance(val, bool):
            if not (key in _OPTIONAL and not val):
                out[key] = TINY[key]
        elif key in SWITCHED_ON and isinstance(val, bool):
            out[key] = True
        elif ("dropout" in key or "pdrop" in key) and isinstance(val, float):
            out[key] = 0.0
        elif key in _SPECIAL_IDS and isinstance(val, int) and val >= TINY["vocab_size"]:
            out[key] = _SPECIAL_IDS[key]
    for key in ("head_dim", "num_key_value_heads"):
        if key in d and d[key] is None:
            out[key] = TINY[key]
    if any(isinstance(d.get(k), int) for k in ("n_routed_experts", "num_experts", "num_local_experts")) and (
            "num_experts_per_tok" in d and d["num_experts_per_tok"] is None):
        out["num_experts_per_tok"] = TINY["num_experts_per_tok"]
    if isinstance(d.get("moe_layer_end_index"), int):
        out["moe_layer_end_index"] = keep - 1
    if isinstance(d.get("n_recurrent_layers"), int):  # input + recurrent + output layers = all layers
        out["n_recurrent_layers"] = keep - out.get("n_input_layers", 0) - out.get("n_output_layers", 0)
    if isinstance(d.get("kv_lora_rank"), int):  # MLA: a latent K/V per query head
        out["num_key_value_heads"] = out.get("num_attention_heads", TINY["num_attention_heads"])
        if "head_dim" in d:
            out["head_dim"] = out["qk_rope_head_dim"]
    return out


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's default config, shrunk (see :data:`TINY`), then ``overrides``."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **DEFAULT_FIXES.get(model_type, {}))
    d = {**shrink_config(config.to_dict()), **overrides}
    for key in ("model_type", "transformers_version"):
        d.pop(key, None)
    return type(config).from_dict(d)


def build_tiny(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The family's tiny model in float64, train mode, matrices redrawn at unit gain (so attention
    is peaked enough that a wrong mask or a lost position shows); the same on every rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    kw = {}
    if getattr(decoder_config(config)[0], "attn_logit_softcapping", None):
        # transformers' eager softmax is float32, and its mask minimum turns a row a window hides
        # entirely into NaN in a float64 model: compare like for like on a float64 eager
        kw["attn_implementation"] = register_eager_float64()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager", **kw)
    model = model.to(torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p.shape[-1] ** 0.5))
    return model


def meta_verdict(model_type: str) -> tuple[str, str]:
    """For a family whose tiny model cannot run: does parallelize refuse its default config (built
    on the meta device)? ``("refused", message)``, ``("accepted, not run", "")`` or
    ``("unbuildable", why)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..comm.mesh import init_mesh

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as e:  # transformers' own validation of its default config
        return "unbuildable", f"{type(e).__name__}: {e}".splitlines()[0][:160]
    try:
        parallelize(model, init_mesh(sp=1, device_type="cpu"))
    except Exception as e:
        return verdict(e)
    return "accepted, not run", ""


def verdict(error: Exception) -> tuple[str, str]:
    """``(outcome, detail)`` of a run that raised: ``"refused"`` for a deliberate refusal
    (:class:`~seqpar.errors.Refused`), ``"crashed"`` for anything else -- a plain ValueError too."""
    if isinstance(error, Refused):
        return "refused", str(error)
    return "crashed", f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class ZooVerdict:
    """One run's verdict, the same on every rank (:func:`agreed_outcome`), and its worst differences
    from the model without seqpar: what every zoo's row holds (each adds, keyword-only, what it ran)."""

    outcome: str
    detail: str = ""
    loss_diff: float = 0.0
    grad_max: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ZooRow(ZooVerdict):
    """One family under one strategy and batch at one SP size (see the module doc for ``outcome``)."""

    family: str
    strategy: str
    batch: str
    p: int
    mixer_modes: tuple[str, ...] = ()  # "Class=mode" of each hybrid token mixer, as it ran


def agreed_outcome(outcome: str, detail: str, group: dist.ProcessGroup) -> tuple[str, str]:
    """Every rank's verdict on one run, made the same everywhere (the worst rank's wins)."""
    order = ("exact", "exact (float32 model)", "refused", "mismatch", "crashed")
    table = share({"outcome": float(order.index(outcome))}, group, problem=detail or None)
    worst = max(range(len(table.rows)), key=lambda r: table.rows[r]["outcome"])
    return order[int(table.rows[worst]["outcome"])], table.problems[worst] or ""


def attention_floor(model: nn.Module, batch: dict[str, Any], reference: tuple[float, dict[str, Any]],
                    solo: DeviceMesh) -> bool:
    """Whether the model's own attention is float32 only: seqpar's ring on one rank (float64
    kernels, no sharding) differs from the model by more than float64 rounding but stays within
    float32 precision. Only eager attention can be (transformers' eager softmax is float32)."""
    config = decoder_config(model.config)[0]
    if compat.attn_implementation(config) != "eager":
        return False
    try:
        r = compare_models(copy.deepcopy(model), batch, solo, strategy="ring", reference=reference,
                           floor=Floor(attention=True))
    except Refused:  # nothing to measure
        return False
    tight = r["loss_diff"] <= LOSS_TOL and r["grad_max"] <= GRAD_TOL and r["f32_rel"] == 0.0
    return r["ok"] and not tight


def _reference(model: nn.Module, kind: str, seq: int, p: int) -> Any:
    """One batch kind's ``(batch, (loss, grads), floor, (loss, grads) at seqpar's loss scale for
    sp=p)`` on the unsharded model, or the exception that stopped the unsharded model (then the
    family cannot be run at this size: not seqpar's). The floors are measured at scale 1, where
    the one-rank runs compare; at a power of two both references are the same bits."""
    try:
        batch = case_batch(ModelCase(batch=kind, seq=seq), decoder_config(model.config)[0].vocab_size)
        ref = reference_grads(model, batch)
        scaled = ref if p & (p - 1) == 0 else reference_grads(model, batch, loss_scale=p)
        return batch, ref, precision_floor(model, batch, ref), scaled
    except Exception as e:
        return e


def zoo_family(name: str, mesh: DeviceMesh, strategies: tuple[str, ...], solo: DeviceMesh) -> list[ZooRow]:
    """Every batch x strategy of one family (a model type or a :data:`VARIANTS` name) on this rank,
    collective over ``mesh``; ``solo`` is a one-rank mesh for measuring the model's own precision.
    Refusals are checked first (a refused family needs no reference); each batch kind's reference
    runs on one rank and reaches the others with one broadcast."""
    from ..comm.mesh import axis_group

    model_type, overrides = VARIANTS.get(name, (name, {}))
    group = axis_group(mesh, "sp")
    p = dist.get_world_size(group)
    try:
        model = build_tiny(model_type, **overrides)
    except Exception:
        outcome, why = meta_verdict(model_type)
        return [ZooRow(outcome, why or "its tiny config does not build", family=name, strategy="-", batch="-", p=p)]
    rows, runnable = [], []
    for strategy in strategies:
        outcome, detail = "exact", ""
        try:  # a refusal needs no run (and some refused models cannot even be copied)
            parallelize(model, mesh, strategy=strategy)
            unparallelize(model)
        except Exception as e:
            outcome, detail = verdict(e)
        outcome, detail = agreed_outcome(outcome, detail, group)  # every rank runs the same strategies
        if outcome == "exact":
            runnable.append(strategy)
        else:
            rows.append(ZooRow(outcome, detail[:2000], family=name, strategy=strategy, batch="-", p=p))
    if not runnable:
        return rows
    with float64_scans(model):
        return _compared(name, model, mesh, runnable, solo, rows)


def _compared(name: str, model: nn.Module, mesh: DeviceMesh, runnable: list[str], solo: DeviceMesh,
              rows: list[ZooRow]) -> list[ZooRow]:
    """``rows`` and every batch x runnable strategy of one family against its reference (see
    :func:`zoo_family`); hybrid mixers that list state passing run in it."""
    from ..comm.mesh import axis_group

    group = axis_group(mesh, "sp")
    p = dist.get_world_size(group)
    mode = STATE if any(STATE in family_of(m).modes for _, m in token_mixers(model)) else None
    refs, floor = {}, Floor()
    for i, (kind, seq) in enumerate(BATCHES):
        owner = i % p
        box = [_reference(model, kind, seq, p) if dist.get_rank(group) == owner else None]
        dist.broadcast_object_list(box, group_src=owner, group=group)
        if isinstance(box[0], Exception):
            e = box[0]
            return [ZooRow("unbuildable", "its tiny config does not run without seqpar "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
                           family=name, strategy="-", batch="-", p=p)]
        batch, ref, kind_floor, scaled = box[0]
        refs[kind], floor = (batch, ref, scaled), floor | kind_floor
    floor = floor | Floor(attention=attention_floor(model, *refs["padded"][:2], solo))  # collective over solo's dp
    for strategy in runnable:
        for kind, _ in BATCHES:
            batch, _, ref = refs[kind]
            outcome, detail, loss_diff, grad_max = ("exact (float32 model)" if floor else "exact"), "", 0.0, 0.0
            ran: tuple[str, ...] = ()
            try:
                r = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=ref, floor=floor,
                                   mixer_mode=mode)
                loss_diff, grad_max = r["loss_diff"], r["grad_max"]
                ran = tuple(f"{c}={m}" for c, m in sorted(r["mixer_modes"].items()))
                if not r["ok"]:
                    outcome, detail = "mismatch", f"worst {r['worst_param']}"
            except Exception as e:
                outcome, detail = verdict(e)
            outcome, detail = agreed_outcome(outcome, detail, group)
            rows.append(ZooRow(outcome, detail[:2000], loss_diff, grad_max, family=name, strategy=strategy,
                               batch=kind, p=p, mixer_modes=ran))
    return rows


def run_zoo(rank: int, world: int, families: list[str] | None = None,
            strategies: tuple[str, ...] = ("ulysses", "ring"), every_strategy: Collection[str] | None = None
            ) -> list[ZooRow]:
    """The zoo on ``world`` ranks (SP size = world); returns this rank's rows.

    ``every_strategy``: None runs every family under every strategy; a set of families runs those
    under every strategy and each other family under one, taking ``strategies`` in turn (a quicker
    sweep that still runs every family and every strategy)."""
    from ..comm.mesh import init_mesh

    torch.set_num_threads(1)
    mesh, solo = init_mesh(sp=world, device_type="cpu"), init_mesh(sp=1, device_type="cpu")
    rows = []
    for i, family in enumerate(families or [*causal_lm_types(), *VARIANTS]):
        mine = strategies if every_strategy is None or family in every_strategy else (strategies[i % len(strategies)],)
        rows.extend(zoo_family(family, mesh, mine, solo))
    return rows
