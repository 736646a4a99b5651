"""One rank's model for ``seqpar train``, built in the order that keeps every rank's memory small::

    meta model           the causal LM --model names, or a sequence-classification model with one
                         output where the objective takes a score (its new head drawn at random); a
                         diffusers DiT for --objective flow-matching: :mod:`.dit_setup`
    + LoRA               --lora-r: peft's adapters, the base frozen (their initial values drawn the
                         same on every rank, :mod:`.lora`)
    parallelize          seqpar.parallelize over the mesh (the strategy; tp and ep from the mesh: the
                         model's own TP plan, the experts cut to this rank's), then reduce_memory
    FSDP2                --fsdp: sharded over every dp x sp rank (averaging), bfloat16 mixed precision
    weights              a built-in: drawn module by module, this rank keeping its shard -- the same bits
                         as the unsharded model's for the seed, on any number of ranks (--ep: drawn whole
                         before parallelize, which cuts each rank's experts from it); a checkpoint under
                         FSDP2: read by rank 0 alone and broadcast tensor by tensor; without FSDP2 every
                         rank loads it (plain gradient sync needs a full replica)
    reference            a preference objective's: the model with its adapters off (LoRA), else a frozen
                         copy of the initial model (refused under FSDP2, which would not shard it)

So no rank > 0 ever holds the whole model under FSDP2.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

import seqpar
from seqpar.integrations.distributed.materialize import load_full_state_dict, materialize, meta_model
from seqpar.integrations.models import BUILTIN_MODELS, build_model, builtin_config, is_diffusers_model
from seqpar.objectives import ADAPTERS_OFF

from .config import DTYPES, TrainConfig, builtin_fields, memory_options, resolve_dtype
from .dit_setup import build_dit_model, config_writer
from .job import Job
from .lora import add_lora, count_params, init_lora, with_lora_names
from .objectives import DATA_KINDS, TrainObjective, objective_of
from .tokenizer import make_tokenizer


def use_fsdp(cfg: TrainConfig, device_type: str, dtype: str) -> bool:
    """FSDP2 when asked, and by default with CUDA or bfloat16 (``dtype``: the resolved --dtype; its
    mixed precision keeps fp32 master weights; autocast would hand attention q/k in fp32 and v in
    bf16) -- never under --ep (FSDP2 would take the expert shards for copies of one tensor)."""
    if cfg.ep > 1:
        return False
    return cfg.fsdp == "on" or (cfg.fsdp == "auto" and (device_type == "cuda" or dtype == "bfloat16"))


def fsdp_options(cfg: TrainConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``fully_shard``'s keywords for the run. bfloat16: bf16 compute, fp32 master weights and
    gradient reduction (the same policy for either --sp-schedule). A dynamic schedule keeps each
    block's parameters gathered from its first forward of a micro-step to the flush pass
    (``reshard_after_forward=False``): ranks run different numbers of bins, so an all-gather per
    bin's backward, over every rank, would wait on ranks that have no such bin (a hang); the price
    is the whole model's parameters held per rank during the step, as without FSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kw: dict[str, Any] = {}
    if dtype == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.sp_schedule == "dynamic":
        kw["reshard_after_forward"] = False
    return kw


def objective_model(cfg: TrainConfig, spec: TrainObjective, hf_tokenizer: Any | None, *, dtype: torch.dtype,
                    **fields: Any) -> nn.Module:
    """The model ``--model`` names (a built-in with config ``fields``, or a checkpoint directory): a
    causal LM, or where the objective takes a score a sequence-classification model with one output
    whose head is new (drawn at random; the body is the causal LM's)."""
    if not spec.scores:
        return build_model(cfg.model, dtype=dtype, **fields)[0]
    from transformers import AutoModelForSequenceClassification

    pad_id = make_tokenizer(hf_tokenizer).pad_id  # transformers' own pooling wants one; seqpar reads the last token
    if cfg.model not in BUILTIN_MODELS:
        torch.manual_seed(cfg.seed)  # the new head: the same draw on every rank
        return AutoModelForSequenceClassification.from_pretrained(cfg.model, num_labels=1, dtype=dtype,
                                                                  pad_token_id=pad_id)
    config = builtin_config(cfg.model, **fields, num_labels=1, pad_token_id=pad_id)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").to(dtype)


@dataclass
class RankModel:
    """A rank's model, ready to train: ``model`` (parallelized, sharded under FSDP2, with its weights),
    ``peft`` (the PeftModel around it with --lora-r, else None), parameter counts, the resolved compute
    dtype's name, whether FSDP2 shards it, and the local attention kernel in words."""

    model: nn.Module
    peft: nn.Module | None
    params: int
    trainable: int
    dtype: str
    use_fsdp: bool
    attention: str

    @property
    def policy(self) -> nn.Module:
        """What the objective runs: the peft model (its adapters inside ``model``), or ``model``."""
        return self.peft or self.model


def build_rank_model(job: Job, mesh: DeviceMesh, device: torch.device, rank: int) -> RankModel:
    """This rank's model for ``job`` (see the module doc). A ValueError (a head or MLP the memory
    switches cannot tile, a checkpoint the data does not fit) is the same on every rank."""
    cfg = job.cfg
    spec = objective_of(cfg.objective)
    if DATA_KINDS[spec.data].model_splits:  # a diffusers DiT (--objective flow-matching), without FSDP2
        model, params, trainable, dtype_name = build_dit_model(cfg, job.strategy, mesh, device)
        return RankModel(model, None, params, trainable, dtype_name, False, seqpar.attention_kernel(model))
    dtype_name = resolve_dtype(cfg, device.type)
    dtype = DTYPES[dtype_name]
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    fsdp = use_fsdp(cfg, device.type, dtype_name)
    model, full_state = _meta_or_loaded(job, spec, param_dtype, device, fsdp, rank)
    peft = None
    if cfg.lora_r:
        peft = add_lora(model, cfg)
        if full_state is not None:  # rank 0's checkpoint, under the adapted layers' names
            full_state = with_lora_names(model, full_state, cfg.seed)
    params, trainable = count_params(model)
    whole_first = cfg.model in BUILTIN_MODELS and cfg.ep > 1
    if whole_first:  # EP cuts each rank's experts from the whole tensors: draw them whole (no FSDP2 under EP)
        torch.manual_seed(cfg.seed)
        materialize(model, device)
    seqpar.parallelize(peft or model, mesh, strategy=job.strategy)  # tp and ep from the mesh
    memory = memory_options(cfg, device.type)
    if memory is not None:
        seqpar.reduce_memory(model, mesh, **memory)
    if fsdp:
        seqpar.apply_fsdp(model, mesh, **fsdp_options(cfg, dtype))  # over every dp x sp rank, averaging
    if cfg.model in BUILTIN_MODELS and not whole_first:
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank, whatever the sharding
        materialize(model, device)
    elif fsdp:
        materialize(model, device, params=False)  # buffers (RoPE); the weights come from rank 0
        load_full_state_dict(model, full_state)  # with the adapters' initial values (LoRA)
    if peft is not None and not (fsdp and cfg.model not in BUILTIN_MODELS):
        init_lora(model, cfg.seed)  # the same adapters on every rank, whatever the sharding
    return RankModel(model, peft, params, trainable, dtype_name, fsdp, seqpar.attention_kernel(model))


def _meta_or_loaded(job: Job, spec: TrainObjective, param_dtype: torch.dtype, device: torch.device, fsdp: bool,
                    rank: int) -> tuple[nn.Module, dict[str, Tensor] | None]:
    """``(model, full state dict or None)``. A built-in, and a checkpoint under FSDP, come on the meta
    device (rank 0 also returns the checkpoint's weights, on the CPU); a checkpoint without FSDP is
    loaded whole on this rank's device."""
    cfg, data = job.cfg, job.data
    if cfg.model in BUILTIN_MODELS:
        with torch.device("meta"):
            model = objective_model(cfg, spec, job.tokenizer, dtype=param_dtype,
                                    **builtin_fields(cfg, data.vocab_size))
        return model, None
    state = None
    if not fsdp:
        model = objective_model(cfg, spec, job.tokenizer, dtype=param_dtype)
        model.to(device)
    else:
        if spec.scores:
            raise ValueError(f"--objective {cfg.objective} from a checkpoint builds the model's new score head on "
                             "every rank, which FSDP2's sharded loading does not do yet: use --fsdp off or a built-in "
                             "--model")
        model = meta_model(cfg.model, dtype=param_dtype)  # first: a refusal comes before any loading
        if rank == 0:  # the only rank that reads the weights
            full = objective_model(cfg, spec, job.tokenizer, dtype=param_dtype)
            state = full.state_dict()
            del full
    vocab = int(model.get_input_embeddings().num_embeddings)
    if data.max_token_id >= vocab:  # prepare_job checked it; a job prepared elsewhere may not have
        raise ValueError(f"the data uses token ids up to {data.max_token_id} but --model {cfg.model!r} "
                         f"embeds {vocab}: give the checkpoint its tokenizer or use a built-in model")
    return model, state


def make_reference(job: Job, built: RankModel) -> nn.Module | str | None:
    """The objective's reference (see the module doc), built after the model has its initial weights;
    None for an objective without one, or data that brings its reference log-probs (RL rollouts'
    ``ref_logps``). ValueError under FSDP2 without LoRA."""
    cfg = job.cfg
    if not objective_of(cfg.objective).make(cfg).needs.reference:
        return None
    if job.data is not None and "ref_logps" in job.data.row(0):
        return None
    if built.peft is not None:
        return ADAPTERS_OFF
    if built.use_fsdp:
        raise ValueError(f"--objective {cfg.objective} keeps a frozen copy of the initial model as its reference, "
                         "which FSDP2 does not shard: add --lora-r (the reference is then the model with its adapters "
                         "off) or use --fsdp off")
    return copy.deepcopy(built.model).requires_grad_(False).eval()


def saved_config(model: nn.Module) -> Any:
    """What a checkpoint writes as the model's config.json (``save_pretrained(dir)``): a transformers
    model's config, or a diffusers DiT's (with its ``_class_name``)."""
    if is_diffusers_model(model):
        return config_writer(model)
    return model.config
