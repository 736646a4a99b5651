"""Vision work per rank under SP: each rank encodes a share of the images and one all-to-all routes the
features (seqpar), against every rank encoding every image and keeping its own placeholders' rows
(what peers do), in one run, on local gloo processes.

    python benchmarks/bench_vision.py                 # P = 2 and 4, 8 images, Qwen2-VL tower, float32

The model is the VLM zoo's Qwen2-VL with a larger vision tower (4 blocks, width 256, 14 x 14 patches);
a row of 8 images of 16 x 16 patches (64 placeholder tokens each) between text. Measured per rank:
the vision step alone, forward and backward (the tower, the projector, the exchange; the text
model does not run): time (median over repeats) and peak live tensor memory
(:class:`seqpar.testing.memory.LiveMemory`). Printed: the slowest rank of each approach, and
divided / whole -- the goal is about 1/P.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqpar.comm.launch import run_distributed

IMAGES, GRID, TEXT = 8, (1, 16, 16), 12  # 8 images of 16 x 16 patches, 12 text tokens around each


def _model():
    from transformers import AutoModelForImageTextToText

    from seqpar.testing.vlm_zoo import tiny_vlm_config

    config = tiny_vlm_config("qwen2_vl")
    vc = config.vision_config
    vc.depth, vc.embed_dim, vc.num_heads, vc.patch_size = 4, 256, 8, 14
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).float().train()


def _batch(model) -> dict:
    cfg, vc = model.config, model.config.vision_config
    g = torch.Generator().manual_seed(1)
    tokens = GRID[0] * GRID[1] * GRID[2] // vc.spatial_merge_size ** 2
    ids = []
    for _ in range(IMAGES):
        ids += torch.randint(3, 200, (TEXT,), generator=g).tolist()
        ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * tokens, cfg.vision_end_token_id]
    ids = torch.tensor([ids])
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return {"input_ids": ids, "labels": ids, "mm_token_type_ids": (ids == cfg.image_token_id).long(),
            "pixel_values": torch.randn(IMAGES * GRID[0] * GRID[1] * GRID[2], width, generator=g),
            "image_grid_thw": torch.tensor([GRID] * IMAGES)}


def _work(rank: int, world: int, repeats: int) -> dict:
    import seqpar
    from seqpar.batch.local_batch import BATCH_KWARG
    from seqpar.comm.mesh import axis_group
    from seqpar.integrations.vlm.encoder import route_visual
    from seqpar.integrations.vlm.features import encoder_rows
    from seqpar.testing.memory import LiveMemory

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    group = axis_group(mesh, "sp")
    model = _model()
    batch = _batch(model)
    local = seqpar.shard_batch(batch, mesh)[BATCH_KWARG]
    mine = (batch["input_ids"] == model.config.image_token_id)[:, local.visual.pieces[rank]]

    def divided() -> None:
        rows = route_visual(model, local, group)["mm_encoder_outputs"]["image"].pooler_output[0]
        rows.pow(2).sum().backward()

    def whole() -> None:  # every rank encodes every image, keeps its placeholders' rows
        rows, _ = encoder_rows(model, "image", {k: batch[k] for k in ("pixel_values", "image_grid_thw")})
        start = int((batch["input_ids"][:, :int(local.visual.pieces[rank][0])] == model.config.image_token_id).sum())
        rows[start:start + int(mine.sum())].pow(2).sum().backward()

    out = {}
    for name, fn in (("divided", divided), ("whole", whole)):
        times = []
        for step in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        with LiveMemory() as mem:
            fn()
        out[name] = (statistics.median(times), mem.peak_bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"vision step (forward + backward), {IMAGES} images of {GRID[1]} x {GRID[2]} patches, Qwen2-VL tower "
          "(4 blocks, width 256), float32; per rank, the slowest rank")
    print(f"{'P':>3} {'divided ms':>11} {'whole ms':>9} {'time ratio':>11} {'divided MiB':>12} {'whole MiB':>10} "
          f"{'memory ratio':>13}")
    for p in args.sizes:
        outs = run_distributed(_work, p, args.repeats, timeout=900)
        t = {k: max(o[k][0] for o in outs) for k in ("divided", "whole")}
        m = {k: max(o[k][1] for o in outs) for k in ("divided", "whole")}
        print(f"{p:>3} {t['divided'] * 1e3:>11.1f} {t['whole'] * 1e3:>9.1f} {t['divided'] / t['whole']:>10.2f}x "
              f"{m['divided'] / 2**20:>12.1f} {m['whole'] / 2**20:>10.1f} {m['divided'] / m['whole']:>12.2f}x")


if __name__ == "__main__":
    main()
