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
