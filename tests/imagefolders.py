"""Small folders in the ImageNet layout for recipe=imagefolder's tests: train/<class>/*, val/<class>/*."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("ant", "bee", "cat")


def smooth_image(rng: np.random.Generator, width: int, height: int, tint: int) -> np.ndarray:
    """uint8 HWC RGB: a smooth random field (compresses like a photo) tinted by class, so it is learnable."""
    coarse = rng.random((4, 4, 3)) * 160
    img = np.asarray(Image.fromarray(coarse.astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC),
                     dtype=np.float32)
    img[..., tint % 3] += 80
    return np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)


def write_image_folder(root: Path, train_per_class: int = 8, val_per_class: int = 4, seed: int = 0,
                       odd_files: bool = True) -> Path:
    """3 classes of JPEGs 40-120 px of mixed shapes; with `odd_files` also a grey JPEG, a CMYK JPEG, a
    palette PNG with transparency, a 16-bit grey PNG, a progressive JPEG, an RGBA PNG (all in train/) and
    a non-image file (notes.txt) to be ignored."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = (int(v) for v in rng.integers(40, 121, size=2))
                Image.fromarray(smooth_image(rng, w, h, label)).save(folder / f"{name}_{i:03d}.JPEG", quality=90)
    if odd_files:
        train = root / "train"
        Image.fromarray(smooth_image(rng, 70, 50, 0)[..., 0], "L").save(train / "ant" / "grey.jpg")
        Image.fromarray(smooth_image(rng, 64, 96, 1)).convert("CMYK").save(train / "bee" / "cmyk.jpg")
        palette = Image.fromarray(smooth_image(rng, 60, 60, 2)).convert("P", palette=Image.Palette.ADAPTIVE)
        palette.info["transparency"] = 0
        palette.save(train / "cat" / "palette.png", transparency=0)
        deep = (smooth_image(rng, 50, 80, 0)[..., 0].astype(np.uint16) * 257)
        Image.fromarray(deep).save(train / "ant" / "deep16.png")
        Image.fromarray(smooth_image(rng, 90, 60, 1)).save(train / "bee" / "progressive.jpg", progressive=True)
        rgba = np.dstack([smooth_image(rng, 48, 48, 2), np.full((48, 48), 128, np.uint8)])
        Image.fromarray(rgba, "RGBA").save(train / "cat" / "alpha.PNG")
        (train / "cat" / "notes.txt").write_text("not an image\n")
    return root


OWN_RECIPES = Path(__file__).parent / "distributed" / "data" / "own"  # indexed_images.py


def _indices(cwd: Path, ranks: int) -> list[list[int]]:
    """Each global step's samples (every rank's share together, sorted), in the order trained; as many
    steps as every rank recorded."""
    import json

    per_rank = [[json.loads(line) for line in (cwd / f"indices-{r}.jsonl").read_text().splitlines()]
                for r in range(ranks)]
    return [sorted(i for share in step for i in share) for step in zip(*per_rank, strict=False)]


def check_two_ranks_resumed_on_one(launch, cwd: Path, elsewhere: Path, root: Path, two: tuple[str, ...],
                                   one: tuple[str, ...], common: tuple[str, ...]) -> None:
    """recipe=imagefolder (indexed_images.py records each step's sample indices) on 2 ranks, checkpointed
    every 2 steps and failed at global step 9 (the second epoch's third step); `launch resume=` on 1 rank
    goes on from the checkpoint after step 8 with the same global batches an uninterrupted 1-rank run
    trains (`elsewhere`: its directory), step for step."""
    import re
    import shutil

    import torch

    for where in (cwd, elsewhere):
        shutil.copy(OWN_RECIPES / "indexed_images.py", where / "indexed_images.py")
    args = ("recipe=indexed_images", f"data.root={root}", "epochs=2", "batch_size=4", *common)
    whole = launch(*args, *one, timeout=300, cwd=elsewhere)
    assert whole.returncode == 0, whole.output
    uninterrupted = _indices(elsewhere, 1)
    per_epoch = len(uninterrupted) // 2
    assert per_epoch > 4 and len(set(sum(uninterrupted[:per_epoch], []))) == 4 * per_epoch
    failed = launch(*args, *two, "checkpoint_every_steps=2", "fault.rank=0", f"fault.step={per_epoch + 2}",
                    timeout=300)
    assert failed.returncode == 1, failed.output
    run_dir = Path(re.search(r"run dir: (\S+)", failed.output).group(1))
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True, map_location="cpu")
    assert (state["epoch"], state["step_in_epoch"]) == (1, 2)
    before = _indices(cwd, 2)
    assert before[:per_epoch + 2] == uninterrupted[:per_epoch + 2]  # 2 ranks train 1 rank's global batches
    for f in cwd.glob("indices-*.jsonl"):
        f.unlink()
    resumed = launch("recipe=indexed_images", f"resume={run_dir}", *one, timeout=300)
    assert resumed.returncode == 0, resumed.output
    assert f"resuming epoch 2 at step 3 of {per_epoch}" in resumed.output
    assert _indices(cwd, 1) == uninterrupted[per_epoch + 2:]
