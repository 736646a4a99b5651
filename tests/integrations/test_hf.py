"""Whole transformers models, sequence-parallel: loss within 1e-9 and every parameter gradient within
1e-8 of the non-SP model (float64), P in {1, 2, 3, 4}; collectives per forward counted; misuse
raising the same ValueError on every rank. One spawn of 4 processes runs everything.

Grid: Llama (GQA 4/2, so 2 KV heads < P = 3, 4; 4 heads not divisible by 3; 6/1 heads), Qwen3
(q/k norm), Mistral (sliding window 5 < sequence), Gemma 2 (softcap 2.0, sliding window, final-logit
softcap); padded (2 rows of different lengths), packed (documents restarting position_ids) and plain
rows; odd lengths (13, 15, 17); zigzag layout; the model's own sdpa, eager and a registered eager.
At P = 1 and 3 make test runs half the grid, every option value still met (the rest: heavy).
"""

import copy

import pytest
import torch
from torch import nn

import seqpar
from seqpar.batch.local_batch import BATCH_KWARG
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import build_model
from seqpar.testing.model_parity import (
    EAGER_FLOAT64,
    F32_RTOL,
    GRAD_TOL,
    LOSS_TOL,
    ModelCase,
    case_batch,
    make_model,
    reference_loss,
    run_model_parity,
)
from seqpar.testing.sampling import covering_sample, field_values

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

SIZES = (1, 2, 3, 4)
GRID = [
    *(ModelCase(model="tiny-llama", batch=b, seq=s) for b, s in (("padded", 16), ("packed", 17), ("plain", 13))),
    ModelCase(model="tiny-llama", batch="padded", seq=15, heads=6, kv_heads=1),
    ModelCase(model="tiny-llama", batch="packed", seq=17, heads=6, kv_heads=1, layout="zigzag"),
    ModelCase(model="tiny-llama", batch="padded", seq=16, layout="zigzag"),
    ModelCase(model="tiny-llama", batch="packed", seq=13, attn="eager", layout="zigzag"),
    # activation checkpointing recomputes each layer (and its collectives) in the backward
    ModelCase(model="tiny-llama", batch="packed", seq=17, checkpointing="non-reentrant"),
    ModelCase(model="tiny-llama", batch="padded", seq=15, checkpointing="reentrant"),
    *(ModelCase(model=m, batch=b, seq=s, attn=a)
      for m, a in (("tiny-qwen3", None), ("tiny-mistral", None), ("tiny-gemma2", EAGER_FLOAT64))
      for b, s in (("padded", 16), ("packed", 17), ("plain", 13))),
]

# make test runs the whole grid at P = 2 and 4; at P = 1 (no exchange) and 3 the half of it that still
# meets every model, batch, length, layout, attention, checkpointing and head count; make verify the rest
SAMPLED = (1, 3)
SAMPLE, REST = covering_sample(GRID, 4, field_values)


def _grid(p):
    return SAMPLE if p in SAMPLED else GRID


def _counts(rank, world):
    """Collectives of shard_batch, one forward and one backward, at 2 and 4 layers."""
    out = {}
    for p in (2, 4):
        mesh = seqpar.init_mesh(sp=p, device_type="cpu")
        for layers in (2, 4):
            model, _ = build_model("tiny-llama", dtype=torch.float64, num_hidden_layers=layers)
            seqpar.parallelize(model, mesh)
            batch = case_batch(ModelCase(batch="padded", seq=16), model.config.vocab_size)
            with count_collectives() as c_shard:
                local = seqpar.shard_batch(batch, mesh)
            with count_collectives() as c_first, torch.no_grad():
                model(**local)  # a model's first forward also checks that every rank chose the same strategy
            with count_collectives() as c_fwd:
                loss = model(**local).loss
            with count_collectives() as c_bwd:
                loss.backward()
            out[(p, layers)] = (dict(c_shard), dict(c_fwd), dict(c_bwd), dict(c_first))
    return out


class _NoHeadsConfig:
    model_type = "none"


def _misuse(rank, world):
    """Every misuse on every rank: the ValueError message (None when nothing was raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, XGLMConfig, XGLMForCausalLM

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = make_model(ModelCase(model="tiny-llama"))
    vocab = model.config.vocab_size
    batch = case_batch(ModelCase(batch="padded", seq=16), vocab)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    seqpar.parallelize(model, mesh)
    local = seqpar.shard_batch(batch, mesh)
    longer = case_batch(ModelCase(batch="plain", seq=12 + (rank == 1)), vocab)
    attempt("sequence dims differ", lambda: seqpar.shard_batch(longer, mesh))
    attempt("already sharded", lambda: seqpar.shard_batch(local, mesh))
    attempt("already sharded on one rank", lambda: seqpar.shard_batch(local if rank == 2 else batch, mesh))
    other = dict(batch, input_ids=(batch["input_ids"] + (rank == 3)) % vocab)
    attempt("different batches", lambda: seqpar.shard_batch(other, mesh))
    attempt("num_items_in_batch differs", lambda: seqpar.shard_batch(batch, mesh, num_items_in_batch=10 + rank))
    attempt("unknown layout on one rank",
            lambda: seqpar.shard_batch(batch, mesh, layout="spiral" if rank == 1 else "contiguous"))
    attempt("shorter than sp", lambda: seqpar.shard_batch(case_batch(ModelCase(batch="plain", seq=3), vocab),
                                                          mesh))
    dp_only = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    attempt("no sp axis: shard_batch", lambda: seqpar.shard_batch(batch, dp_only))
    attempt("no sp axis: parallelize", lambda: seqpar.parallelize(make_model(ModelCase()), dp_only))
    xglm = XGLMForCausalLM(XGLMConfig(vocab_size=64, d_model=32, num_layers=1, attention_heads=4, ffn_dim=64))
    attempt("attention not through AttentionInterface", lambda: seqpar.parallelize(xglm, mesh))
    attempt("not a transformers model", lambda: seqpar.parallelize(nn.Linear(4, 4), mesh))
    with torch.device("meta"):  # only its structure matters: it is refused before anything runs
        hybrid = AutoModelForCausalLM.from_config(AutoConfig.for_model("minimax", num_hidden_layers=4))
    attempt("a linear-attention hybrid", lambda: seqpar.parallelize(hybrid, mesh))
    attempt("parallelized twice", lambda: seqpar.parallelize(model, mesh))
    attempt("unsharded batch into a parallel model", lambda: model(**batch))
    attempt("unknown strategy", lambda: seqpar.parallelize(make_model(ModelCase()), mesh, strategy="nope"))
    # the fuzz's finding: ranks on different strategies paired different collectives (a hang or a gloo abort)
    other_strategy = seqpar.parallelize(make_model(ModelCase()), mesh, strategy="ring" if rank == 1 else "ulysses")
    attempt("strategies differ across ranks", lambda: other_strategy(**local))
    attn = AttentionInterface()[model.config._attn_implementation]  # seqpar's function, as layers call it
    module = model.model.layers[0].self_attn
    q = torch.randn(2, 4, local["input_ids"].shape[1], 8, dtype=torch.float64)
    k = torch.randn(2, 2, q.shape[2], 8, dtype=torch.float64)
    attempt("the model's own mask", lambda: attn(module, q, k, k, torch.zeros(2, 1, q.shape[2], q.shape[2]),
                                                 scaling=0.3, **{BATCH_KWARG: local[BATCH_KWARG]}))
    # cross-attention (keys not the sharded sequence) is left to the model's own function
    kx = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    got, _ = attn(module, q, kx, kx, None, scaling=0.3, **{BATCH_KWARG: local[BATCH_KWARG]})
    want, _ = AttentionInterface()["sdpa"](module, q, kx, kx, None, scaling=0.3)
    errors["cross-attention left alone"] = float((got - want).abs().max())
    # after all that, the model still works, and unparallelize gives the plain model back
    errors["loss after misuse"] = float(model(**local).loss.detach())
    twin = copy.deepcopy(model)  # e.g. a DPO reference model
    seqpar.unparallelize(model)
    errors["twin loss"] = float(twin(**local).loss.detach())  # the copy keeps working
    errors["loss unparallelized"] = float(reference_loss(model, batch).detach())
    errors["refused model's attention"] = xglm.config._attn_implementation
    return errors


def _submodels(rank, world):
    """A vision-language model: only the text decoder's attention becomes seqpar's."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2),
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, image_size=8, patch_size=4))
    model = LlavaForConditionalGeneration(config)
    before = (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation)
    with seqpar.parallelized(model, mesh):
        during = (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation)
    after = (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation)
    return before, during, after


def _control(rank, world):
    """The harness is sensitive: a sharded batch through the *un*parallelized model (local
    attention, local loss mean) must miss the reference by far."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = make_model(ModelCase())
    batch = case_batch(ModelCase(batch="padded", seq=16), model.config.vocab_size)
    ref = float(reference_loss(copy.deepcopy(model), batch).detach())
    local = seqpar.shard_batch(batch, mesh)
    return abs(float(model(**local).loss.detach()) - ref)


def _kernels(rank, world):
    """What seqpar.attention_kernel says each strategy / attn_implementation runs on CPU."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    said = {}
    for strategy, impl in (("ulysses", "sdpa"), ("ulysses", "eager"), ("ring", "sdpa")):
        model = make_model(ModelCase(attn=impl))
        with seqpar.parallelized(model, mesh, strategy=strategy):
            said[strategy, impl] = seqpar.attention_kernel(model)
        with seqpar.parallelized(model, mesh, strategy=strategy, kernel="tiled"):
            said[strategy, impl, "tiled"] = seqpar.attention_kernel(model)
    return said


def _worker(rank, world):
    torch.set_num_threads(1)
    rows = run_model_parity(rank, world, GRID, (2, 4)) + run_model_parity(rank, world, SAMPLE, SAMPLED)
    return {"rows": rows, "counts": _counts(rank, world),
            "misuse": _misuse(rank, world), "submodels": _submodels(rank, world), "control": _control(rank, world),
            "kernels": _kernels(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=400)


def _check_rows(per_rank, case, p):
    rows = [r for res in per_rank for r in res["rows"] if r["P"] == p and r["label"] == case.label()]
    assert len(rows) >= p  # every rank of the group reported
    for r in rows:
        assert r["loss_diff"] <= LOSS_TOL, f"loss differs by {r['loss_diff']:.2e}"
        assert r["grad_max"] <= GRAD_TOL, f"grad of {r['worst_param']} differs by {r['grad_max']:.2e}"
        # Gemma's norm weights are float32 inside the model itself; all else is float64-exact
        assert r["f32_rel"] <= F32_RTOL
        # measured on the reference: only Gemma's norms (1 + weight.float()) sum in float32
        assert (r["f32_params"] > 0) == (case.model == "tiny-gemma2"), r


@pytest.mark.parametrize(("case", "p"), [(c, p) for c in GRID for p in SIZES if c in _grid(p)],
                         ids=lambda x: f"P{x}" if isinstance(x, int) else x.label().replace(" ", "-"))
def test_model_parity(results, case, p):
    _check_rows(results, case, p)


def _rest(rank, world):
    return {"rows": run_model_parity(rank, world, REST, SAMPLED)}


@pytest.mark.heavy
def test_model_parity_rest_of_the_grid():
    per_rank = run_distributed(_rest, 4, timeout=600)
    for case in REST:
        for p in SAMPLED:
            _check_rows(per_rank, case, p)


def test_sample_meets_every_option_value_and_the_rest_completes_it():
    assert len(SAMPLE) + len(REST) == len(GRID) and len(SAMPLE) <= len(GRID) // 2
    assert sorted(c.label() for c in SAMPLE + REST) == sorted(c.label() for c in GRID)
    assert set().union(*map(field_values, SAMPLE)) == set().union(*map(field_values, GRID))


def test_collectives_per_forward(results):
    # shard_batch: one validation all-gather; forward: ulysses' 2 all-to-all exchanges per layer
    # (batched point-to-point transfers) and the loss's one all-reduce (which also carries the
    # batch's attention failures: a failure on one rank is raised on every rank, see
    # seqpar.comm.guard); backward: the same per layer, and the batch's failure check when it ends
    # (one tiny all-gather per backward, not per layer). Nothing else. A model's first forward adds
    # one tiny all-gather: every rank parallelized it with the same strategy.
    for res in results:
        for (p, layers), (shard, fwd, bwd, first) in res["counts"].items():
            assert shard == {"all_gather_flat": 1}, (p, layers, shard)
            per_layer = {"batch_isend_irecv": 2 * layers}
            assert first == {**per_layer, "all_reduce": 1, "all_gather_flat": 1}, (p, layers, first)
            assert fwd == {**per_layer, "all_reduce": 1}, (p, layers, fwd)
            assert bwd == {**per_layer, "all_gather_flat": 1}, (p, layers, bwd)


MISUSE = {
    "sequence dims differ": "sequence length",
    "already sharded": "already sharded",
    "already sharded on one rank": "rank 2: this batch is already sharded",
    "different batches": "the batch content (input_ids) differs across ranks",
    "shorter than sp": "leaves an SP rank without tokens",
    "num_items_in_batch differs": "num_items_in_batch differs across ranks",
    "unknown layout on one rank": "layout differs across ranks: ['0', 'absent', '0', '0']",
    "no sp axis: shard_batch": "no 'sp' axis",
    "no sp axis: parallelize": "no 'sp' axis",
    "attention not through AttentionInterface": "does not route its attention through",
    "not a transformers model": "is not a PreTrainedModel",
    "a linear-attention hybrid": "config.layer_types has ['linear_attention']",  # MiniMax's lightning attention
    "parallelized twice": "already parallelized",
    "unsharded batch into a parallel model": "shard_batch",
    "unknown strategy": "unknown strategy 'nope'",
    "strategies differ across ranks": "the strategy differs across ranks: ['2', '1', '2', '2']",
    "the model's own mask": "passes its own attention mask",
}


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_raises_on_every_rank(results, name):
    messages = [res["misuse"][name] for res in results]
    assert all(m is not None and MISUSE[name] in m for m in messages), messages
    assert len(set(messages)) == 1  # the same message everywhere


def test_model_usable_after_misuse_and_unparallelize(results):
    for res in results:
        m = res["misuse"]
        assert abs(m["loss after misuse"] - m["loss unparallelized"]) <= LOSS_TOL
        assert m["twin loss"] == m["loss after misuse"]
        assert not m["refused model's attention"].startswith("seqpar")
        assert m["cross-attention left alone"] == 0.0


def test_only_the_text_decoder_is_parallelized(results):
    before, during, after = results[0]["submodels"]
    assert during[0].startswith("seqpar_ulysses_") and during[1] == before[1]
    assert after == before


def test_harness_detects_local_attention(results):
    assert all(res["control"] > 1e-3 for res in results)


def test_the_auto_kernel_choice_is_said(results):
    said = results[0]["kernels"]
    assert said["ulysses", "sdpa"].startswith("the model's sdpa") and "flash_cpu (varlen" in said["ulysses", "sdpa"]
    assert "eager" in said["ulysses", "eager"] and "dense mask" in said["ulysses", "eager"]
    assert said["ring", "sdpa"].startswith("flash_cpu (varlen, returns lse")
    assert all(said[k].startswith("tiled (as passed") for k in said if len(k) == 3)
