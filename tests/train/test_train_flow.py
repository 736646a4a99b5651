"""``seqpar train --objective flow-matching``: one step at sp=2 and 3 (Ulysses, ring, LoRA) equals the
step at sp=1 in float64 (loss within 1e-9, every gradient and every weight after the update within
1e-8); the embedded default's held-out loss falls and it draws samples.png; a resumed run continues the
same loss curve; the export loads in diffusers with the trained model's output; the latents files
(.safetensors, .npz, .parquet) read alike, and every bad file or option is a ValueError naming it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train.checks import check_config
from seqpar.train.job import prepare_job
from seqpar.train.latent_data import load_latents, read_latents
from seqpar.train.loop import _gather_stats, run_training, start_run
from seqpar.train.sources import EVAL, TRAIN, stack

pytestmark = pytest.mark.distributed

LOSS_TOL, WEIGHT_TOL = 1e-9, 1e-8
SHAPE, TEXT = (3, 5, 20, 28), (3, 16)  # 5 x 5 x 7 = 175 tokens through tiny-wan's 1 x 4 x 4 patches: no P divides it


def _samples(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE, generator=g), torch.randn(n, *TEXT, generator=g)


def _safetensors(path, latents, text, **extra):
    from safetensors.torch import save_file

    save_file({"latents": latents.contiguous(), "text_embeds": text.contiguous(), **extra}, str(path))
    return str(path)


def _parquet(path, latents, text, shape=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"latents": [x.reshape(-1).tolist() for x in latents],
            "text_embeds": [e.reshape(-1).tolist() for e in text],
            "latents_shape": [shape or list(x.shape) for x in latents],
            "text_embeds_shape": [list(e.shape) for e in text]}
    pq.write_table(pa.table(rows), str(path))
    return str(path)


def _step(cfg, world):
    """One step of ``cfg`` on this rank (float64 casts kept float64): loss, gradients and weights after."""
    from seqpar.testing.float64_casts import Float64Casts

    run = start_run(prepare_job(cfg, world))
    with Float64Casts():
        share, _ = run.steps.forward_backward(0)
    loss, _, _ = _gather_stats(run.ctx, share)
    grads = {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}
    run.optimization.apply()
    weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {"loss": loss, "grads": grads, "weights": weights}


def _steps(rank, world, cases):
    return {name: _step(cfg, world) for name, cfg in cases.items()}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flow")
    data = _safetensors(tmp / "odd.safetensors", *_samples(8))
    base = TrainConfig(objective="flow-matching", model="tiny-wan", data=[data], dtype="float64", micro_batch=3,
                       grad_accum=2, steps=1, warmup=0, lr=1e-3, eval_rows=0, checkpoint="none", tiled_mlp=False,
                       flow_weighting="cosmap", progress=False, plot=False, save_dir=str(tmp / "unused"))
    cases = {"plain": base.replace(sp=1), "lora": base.replace(sp=1, lora_r=4)}
    out = {1: run_distributed(_steps, 1, cases, timeout=300)[0]}
    out[2] = run_distributed(_steps, 2, {**{k: c.replace(sp=2) for k, c in cases.items()},
                                         "ring": base.replace(sp=2, strategy="ring"),
                                         # dp=2: each dp rank 3 of the step's 6 samples in one micro-batch
                                         "dp": base.replace(sp=1, grad_accum=1)}, timeout=300)[0]
    out[3] = run_distributed(_steps, 3, {"plain": base.replace(sp=3)}, timeout=300)[0]
    return out


@pytest.mark.parametrize("p,case,ref", [(2, "plain", "plain"), (2, "ring", "plain"), (2, "lora", "lora"),
                                        (3, "plain", "plain"), (2, "dp", "plain")])
def test_one_step_equals_sp1(steps, p, case, ref):
    """175 tokens a sample (no P divides them), 4 heads (3 does not divide them), 3 samples x 2 micro-batches,
    SD3's cosmap weighting: the step's loss, every gradient and every weight after AdamW equal sp=1's (and
    dp=2 x sp=1's, the same 6 samples a step)."""
    got, want = steps[p][case], steps[1][ref]
    assert abs(got["loss"] - want["loss"]) <= LOSS_TOL, (got["loss"], want["loss"])
    assert got["grads"].keys() == want["grads"].keys() and got["grads"]
    for kind, tol in (("grads", WEIGHT_TOL), ("weights", WEIGHT_TOL)):
        worst = max((float((got[kind][n] - want[kind][n]).abs().max()), n) for n in want[kind])
        assert worst[0] <= tol, (kind, worst)
    if case == "lora":  # only the adapters train
        assert all(".lora_" in n for n in got["grads"])


def test_the_weights_move(steps):
    """The step changes the weights (so the comparison above compares something)."""
    plain = steps[1]["plain"]
    assert plain["loss"] > 0 and max(float(g.abs().max()) for g in plain["grads"].values()) > 0


def _lifecycle(rank, world, cfgs):
    part, exported = cfgs
    out = {"whole": run_training(prepare_job(part.replace(save_dir=part.save_dir + "_whole"), world))}
    run_training(prepare_job(part, world), stop_after=2)
    out["resumed"] = run_training(prepare_job(part.replace(resume=True), world))
    out["exported"] = run_training(prepare_job(exported, world))
    return out


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """A short run at sp=2, the same run interrupted at step 2 and resumed, and a float64 LoRA run exported
    at the end: one start of 2 ranks."""
    tmp = tmp_path_factory.mktemp("flow_runs")
    data = _safetensors(tmp / "odd.safetensors", *_samples(12))
    part = TrainConfig(objective="flow-matching", model="tiny-wan", data=[data], steps=4, warmup=1, lr=3e-3,
                       micro_batch=2, eval_rows=1, eval_every=0, save_every=2, progress=False, plot=False,
                       save_dir=str(tmp / "part"))
    exported = part.replace(steps=1, dtype="float64", lora_r=4, export_hf=True, save_dir=str(tmp / "hf"))
    out = run_distributed(_lifecycle, 2, (part, exported), timeout=600)[0]
    return {"tmp": tmp, **out, "cfg": exported}


def _default(rank, world, cfg):
    return run_training(prepare_job(cfg, world))


@pytest.mark.heavy
def test_the_default_learns_and_draws_samples(tmp_path):
    """``seqpar train --objective flow-matching`` as the command line builds it (the objective's own
    defaults: tiny-wan, 300 steps of 4 clips, sp=2): the held-out flow loss falls below half of where it
    started, and samples.png is drawn."""
    import argparse

    from seqpar.cli.train import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["train", "--objective", "flow-matching", "--no-progress",
                                              "--save-dir", str(tmp_path / "run")]))
    s = run_distributed(_default, 2, cfg, timeout=900)[0]
    assert s.sp == 2 and s.steps == 300 and s.tokens_per_step == 4 * 1024
    assert s.final_eval.loss < 0.5 * s.first_eval.loss, (s.first_eval, s.final_eval)
    assert s.samples and os.path.getsize(s.samples) > 10_000


def test_resume_continues_the_same_curve(lifecycle):
    """Steps 3, 4 after resuming at 2 are the uninterrupted run's (the noise and timesteps come from each
    unit's seed, a pure function of --seed and the unit's index; the same float32 math in the same order)."""
    resumed, whole = lifecycle["resumed"], lifecycle["whole"]
    assert resumed.resumed_step == 2 and [s for s, _ in resumed.losses] == [3, 4]
    assert resumed.losses == whole.losses[2:], (resumed.losses, whole.losses)
    assert resumed.final_eval == whole.final_eval


def test_export_loads_in_diffusers_with_the_trained_output(lifecycle, tmp_path):
    """--export-hf and seqpar export of a LoRA run (float64) write a save_pretrained directory: its weights
    in a fresh model give the trained model's output (the checkpoint's weights, adapters unmerged) within
    1e-10; WanTransformer3DModel.from_pretrained loads it, within 1e-6 (diffusers keeps Wan's norms and
    time embedder in float32 on loading: _keep_in_fp32_modules)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from seqpar.integrations.diffusers.catalog import build_dit
    from seqpar.train.checkpoint import latest_checkpoint, load_model_weights
    from seqpar.train.export import export_checkpoint
    from seqpar.train.lora import add_dit_lora

    s, cfg = lifecycle["exported"], lifecycle["cfg"]
    ckpt = latest_checkpoint(cfg.save_dir)
    trained = build_dit("tiny-wan", dtype=torch.float64)
    add_dit_lora(trained, cfg)
    load_model_weights(ckpt, trained)
    e = export_checkpoint(cfg.save_dir, str(tmp_path / "out"))
    assert e.lora == "merged" and "diffusion_pytorch_model.safetensors" in e.files
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 3, 4, 16, 16, generator=g).double(), torch.randn(1, 3, 16, generator=g).double()
    t = torch.tensor([400.0], dtype=torch.float64)
    with torch.no_grad():
        want = trained.eval()(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
        for out in (e.out, s.export):
            fresh = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(out)).double().eval()
            fresh.load_state_dict(load_file(os.path.join(out, "diffusion_pytorch_model.safetensors")))
            got = fresh(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
            assert float((got - want).abs().max()) <= 1e-10, out
            loaded = WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.float64).eval()
            assert not any("lora" in n for n, _ in loaded.named_parameters())
            got = loaded(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
            assert float((got - want).abs().max()) <= 1e-6, out
    with pytest.raises(ValueError, match="--lora-export adapter"):
        export_checkpoint(cfg.save_dir, str(tmp_path / "adapter"), lora="adapter")


def test_the_three_formats_read_alike(tmp_path):
    latents, text = _samples(5, seed=1)
    st = _safetensors(tmp_path / "a.safetensors", latents, text)
    npz = str(tmp_path / "a.npz")
    np.savez(npz, latents=latents.numpy(), text_embeds=text.numpy().astype(np.float16))
    pq = _parquet(tmp_path / "a.parquet", latents, text)
    for path in (st, npz, pq):
        got_l, got_t, what = read_latents([path])
        assert torch.equal(got_l, latents), path
        assert torch.allclose(got_t, text, atol=1e-2 if path.endswith("npz") else 0), path  # float16 in the npz
        assert "5 samples" in what and "[3, 5, 20, 28]" in what
    both = load_latents([st, pq], seed=2, eval_rows=1)
    assert both.n_eval == 1 and both.n_train == 9
    unit = both.row(3, TRAIN)
    assert unit["latents"].shape == (1, *SHAPE) and unit["text_embeds"].shape == (1, *TEXT)
    batch = stack([both.row(i, TRAIN) for i in range(3)] + [both.row(0, EVAL)])
    assert batch["latents"].shape == (4, *SHAPE) and batch["seed"].shape == (4, 1)
    assert len(set(batch["seed"].reshape(-1).tolist())) == 4  # every unit its own noise


@pytest.mark.parametrize("make,match", [
    (lambda d, lat, txt: _safetensors(d / "k.safetensors", lat, txt, extra=txt.clone()),
     r"k\.safetensors.*unexpected \['extra'\]"),
    (lambda d, lat, txt: np.savez(d / "k.npz", latent=lat.numpy(), text_embeds=txt.numpy()) or str(d / "k.npz"),
     r"k\.npz.*missing \['latents'\]"),
    (lambda d, lat, txt: _safetensors(d / "s.safetensors", lat[:, 0], txt), r"s\.safetensors: 'latents' has shape "
     r"\[4, 5, 20, 28\], expected \[N, C, F, H, W\]"),
    (lambda d, lat, txt: _safetensors(d / "n.safetensors", lat, txt[:3]),
     r"n\.safetensors: 4 rows of 'latents' but 3"),
    (lambda d, lat, txt: _parquet(d / "r.parquet", lat, txt, shape=[3, 5, 20, 27]),
     r"r\.parquet row 0: 'latents' holds 8400 values"),
    (lambda d, lat, txt: np.savez(d / "o.npz", latents=np.array([object()] * 4), text_embeds=txt.numpy()) or
     str(d / "o.npz"), r"o\.npz.*(pickle|never pickled)"),
    (lambda d, lat, txt: str(torch.save({}, d / "x.pt") or d / "x.pt"),
     r"x\.pt.*reads \.safetensors, \.npz, \.parquet"),
])
def test_bad_files_are_named(tmp_path, make, match):
    latents, text = _samples(4)
    path = make(tmp_path, latents, text)
    with pytest.raises(ValueError, match=match):
        read_latents([path])


def test_files_whose_samples_disagree_are_named(tmp_path):
    a = _safetensors(tmp_path / "a.safetensors", *_samples(2))
    lat, txt = _samples(2)
    b = _safetensors(tmp_path / "b.safetensors", lat[:, :, :4], txt)
    with pytest.raises(ValueError, match=r"b\.safetensors: 'latents' samples are \[3, 4, 20, 28\], but .*a\.safe"):
        read_latents([a, b])
    rows = _parquet(tmp_path / "c.parquet", lat, txt)
    import pyarrow.parquet as pq

    table = pq.read_table(rows).to_pylist()
    table[1]["latents"], table[1]["latents_shape"] = table[1]["latents"][:1400], [1, 5, 10, 28]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), rows)
    with pytest.raises(ValueError, match=r"c\.parquet row 1: 'latents' has shape \[1, 5, 10, 28\], row 0 \[3, 5"):
        read_latents([rows])


FLOW = TrainConfig(objective="flow-matching", model="tiny-wan")


@pytest.mark.parametrize("changes,match", [
    ({"packing": True}, "--packing does not apply"),
    ({"chat_template": __file__}, "--chat-template does not apply"),
    ({"tiled_loss": False}, "--no-tiled-loss does not apply"),
    ({"loss_tile": 64}, "--loss-tile does not apply"),
    ({"plan": "auto"}, "--plan does not apply"),
    ({"tp": 2, "nproc": 4}, "--tp 2: a diffusers transformer runs sequence parallelism alone"),
    ({"ep": 2}, "--ep 2: a diffusers transformer"),
    ({"fsdp": "on"}, "--fsdp on: --objective flow-matching trains its DiT without FSDP2"),
    ({"dtype": "bfloat16"}, "--dtype bfloat16"),
    ({"lora_r": 4, "lora_export": "adapter"}, "--lora-export adapter"),
    ({"sp_schedule": "dynamic"}, "--sp-schedule static"),
    ({"beta": 0.5}, "--beta does nothing for --objective flow-matching"),
    ({"train_on": "all"}, "--train-on all does nothing for --objective flow-matching"),
])
def test_options_that_do_not_apply_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        check_config(FLOW.replace(**changes))


def test_other_objective_options_and_models_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--flow-weighting does nothing for --objective sft"):
        check_config(TrainConfig(flow_weighting="cosmap"))
    with pytest.raises(ValueError, match="neither a built-in DiT"):
        prepare_job(FLOW.replace(model="tiny-llama", save_dir=str(tmp_path / "a")))
    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="is a FluxTransformer2DModel; .* calls WanTransformer3DModel"):
        prepare_job(FLOW.replace(model=str(tmp_path / "flux"), save_dir=str(tmp_path / "b")))
    data = _safetensors(tmp_path / "d.safetensors", *_samples(2))
    with pytest.raises(ValueError, match="--seq-len 100: the latents set the sequence \\(175 tokens"):
        prepare_job(FLOW.replace(data=[data], seq_len=100, save_dir=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="the text embeddings are 16 wide but --model tiny-wan takes text_dim=8"):
        prepare_job(FLOW.replace(data=[data], model_config='{"text_dim": 8}', save_dir=str(tmp_path / "d")))
    with pytest.raises(ValueError, match="latents' height 20 \\(patch 8\\)"):
        prepare_job(FLOW.replace(data=[data], model_config='{"patch_size": [1, 8, 8]}', save_dir=str(tmp_path / "e")))
    with pytest.raises(ValueError, match="--lora-targets nope"):
        prepare_job(FLOW.replace(data=[data], lora_r=2, lora_targets=["nope"], save_dir=str(tmp_path / "f")))


def test_cli_lists_it_and_applies_its_defaults(capsys):
    import argparse

    from seqpar.cli.train import add_parser, config_from_args
    from seqpar.train.objectives import OBJECTIVES

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "flow-matching (rectified flow on a diffusers video transformer" in text
    assert "--flow-weighting {none,sigma_sqrt,cosmap}" in text and "flow-matching runs with --model tiny-wan" in text
    cfg = config_from_args(parser.parse_args(["train", "--objective", "flow-matching", "--lr", "0.01"]))
    assert cfg.model == "tiny-wan" and cfg.lr == 0.01 and cfg.micro_batch == OBJECTIVES["flow-matching"].defaults[
        "micro_batch"]
    assert config_from_args(parser.parse_args(["train"])).model == "tiny-llama"


def test_weighting_is_sd3s():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from seqpar.objectives.flow_matching import loss_weights

    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    assert loss_weights("none", t) is None
    for scheme in ("sigma_sqrt", "cosmap"):
        assert torch.allclose(loss_weights(scheme, t), compute_loss_weighting_for_sd3(scheme, t).double(), rtol=1e-6)
