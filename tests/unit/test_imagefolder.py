"""recipe=imagefolder without a launch: the folder's checks (one line each), the datasets' crops (shapes,
dtypes, determinism, evaluation geometry, any image mode), bad files, and the GPU path's code run on the CPU
(batched decode_jpeg, crops by one roi_align) against the CPU path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torchvision", reason="recipe=imagefolder needs torchvision (pip install torchvision)")
import torch
from PIL import Image

from launcher.data.folders import scan
from launcher.data.gpu_decode import Normalizer, gpu_batch
from launcher.data.images import (
    MEAN,
    STD,
    BadImageError,
    GpuWork,
    ImageFolderSplit,
    collate,
    decode_eval_crop,
    eval_geometry,
    random_resized_crop_box,
    to_rgb,
)
from launcher.errors import LaunchError
from launcher.recipes.imagefolder import ImageFolder
from tests.conftest import config_of
from tests.imagefolders import CLASSES, write_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("imagenet"))


def refusal(root: Path) -> str:
    with pytest.raises(LaunchError) as err:
        scan(root)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"data.root={root} is not valid: ")
    assert err.value.exit_code == 2
    return text


# ---- the folder --------------------------------------------------------------------------------------------


def test_the_folder_reads_like_torchvisions_imagefolder(folder):
    from torchvision.datasets import ImageFolder as Reference

    splits = scan(folder)
    for split in ("train", "val"):
        ref = Reference(str(folder / split), allow_empty=False)
        assert splits[split].classes == ref.classes == list(CLASSES)
        assert splits[split].samples == [(p, label) for p, label in ref.samples if not p.endswith(".txt")]
    names = {Path(p).name for p, _ in splits["train"].samples}
    assert "notes.txt" not in names and {"grey.jpg", "cmyk.jpg", "palette.png", "deep16.png", "alpha.PNG"} <= names
    assert len(splits["train"].samples) == 3 * 8 + 6 and len(splits["val"].samples) == 3 * 4


def test_each_layout_problem_is_one_line_naming_it(tmp_path):
    assert "no such folder" in refusal(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("x")
    assert "is a file, not a folder" in refusal(tmp_path / "a_file")

    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    assert "has no train/ folder (it holds images/)" in refusal(root)
    write_image_folder(root, 2, 1, odd_files=False)
    shutil.rmtree(root / "val")
    assert "has no val/ folder" in refusal(root) and "sort it into val/<class>/" in refusal(root)

    write_image_folder(root, 2, 1, odd_files=False)
    (root / "val" / "dog").mkdir()
    Image.new("RGB", (8, 8)).save(root / "val" / "dog" / "d.jpg")
    assert "only in val/: dog" in refusal(root)
    shutil.rmtree(root / "val" / "dog")
    shutil.rmtree(root / "val" / "bee")
    assert "only in train/: bee" in refusal(root)

    write_image_folder(root, 2, 1, odd_files=False)
    for f in (root / "train" / "cat").iterdir():
        f.unlink()
    (root / "train" / "cat" / "readme.txt").write_text("no images here")
    assert "train/cat/ holds no images (files ending .jpg .jpeg .png .bmp .webp" in refusal(root)

    flat = tmp_path / "flat"
    (flat / "val" / "x").mkdir(parents=True)
    (flat / "train").mkdir()
    Image.new("RGB", (8, 8)).save(flat / "train" / "a.jpg")
    assert "train/ holds images but no class folders" in refusal(flat)

    one = tmp_path / "one"  # (a new user's trial: one class trained to "100%" in silence)
    for split in ("train", "val"):
        (one / split / "circle").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(one / split / "circle" / "c.png")
    assert "holds one class only (circle/): a classifier needs two or more class folders" in refusal(one)


def test_a_folder_that_cannot_be_listed_is_one_line_naming_it(tmp_path, monkeypatch):
    """os.walk passed over a folder it could not list (its images silently missing); the scan names it."""
    import os

    root = write_image_folder(tmp_path, 2, 1, odd_files=False)
    (root / "train" / "bee" / "more").mkdir()
    listing = os.scandir

    def scandir(path="."):
        if str(path).endswith("more"):
            raise PermissionError(13, "Permission denied", str(path))
        return listing(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert f"cannot list {root / 'train' / 'bee' / 'more'} (Permission denied): make it readable" in refusal(root)


def test_class_folders_that_count_alike_but_differ_by_name_are_refused(tmp_path):
    """train/{cat,dog} and val/{cat,fox}: as many classes, so a check of the count alone would pass, and
    val/fox's images would be scored as dogs (label 1 in both)."""
    root = tmp_path / "data"
    for split, names in (("train", ("cat", "dog")), ("val", ("cat", "fox"))):
        for name in names:
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(root / split / name / "x.jpg")
    text = refusal(root)
    assert "train/ and val/ must hold the same class folders" in text
    assert "only in train/: dog; only in val/: fox" in text


def test_hidden_files_and_folders_are_no_classes_or_images(tmp_path):
    root = write_image_folder(tmp_path, 2, 1, odd_files=False)
    (root / "train" / ".ipynb_checkpoints").mkdir()
    (root / "train" / "ant" / "._ant_000.JPEG").write_bytes(b"\0\5AppleDouble")
    splits = scan(root)
    assert splits["train"].classes == list(CLASSES)
    assert all(not Path(p).name.startswith(".") for p, _ in splits["train"].samples)


def test_a_split_holding_only_a_hidden_image_name_is_told_it_has_no_class_folders(tmp_path):
    """macOS's ._name.jpg files are not images: a val/ holding only one is not "holding images"."""
    root = write_image_folder(tmp_path, 2, 1, odd_files=False)
    shutil.rmtree(root / "val")
    (root / "val").mkdir()
    (root / "val" / "._ant_000.jpg").write_bytes(b"\0\5AppleDouble")
    with pytest.raises(LaunchError) as err:
        scan(root)
    assert "val/ holds no class folders" in str(err.value), str(err.value)


def test_images_in_a_class_folders_subfolders_are_ordered_as_torchvision_orders_them(tmp_path):
    """Folder by folder in sorted order of their paths ('x-z' sorts before 'x/y'), whatever order the
    filesystem lists them in: the same indices, so the same labels and the same augmentation, as torchvision."""
    from torchvision.datasets import ImageFolder as Reference

    root = write_image_folder(tmp_path, 1, 1, odd_files=False)
    for sub in ("x", "x/y", "x-z", "a", "x/y/deeper"):
        (root / "train" / "ant" / sub).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(root / "train" / "ant" / sub / "img.jpg")
    ref = Reference(str(root / "train"), allow_empty=False)
    assert scan(root)["train"].samples == ref.samples


def test_linked_folders_are_followed_once_and_loops_and_second_paths_are_left_out_and_said(tmp_path, capsys):
    """A link back to a folder above it multiplied the training set (os.walk followed it 40 levels deep), and
    a second path to a folder or file read its images twice: each image is a sample once, the real path kept,
    and one warning line says what was left out. A linked folder reached once (data kept elsewhere) counts."""
    root = write_image_folder(tmp_path / "data", 4, 2, odd_files=False)
    real = {split: [(p, label) for p, label in folders.samples] for split, folders in scan(root).items()}
    elsewhere = write_image_folder(tmp_path / "elsewhere", 2, 1, odd_files=False)
    (root / "train" / "ant" / "more").symlink_to(elsewhere / "train" / "ant")  # followed: read once
    deep = root / "train" / "ant" / "sub"
    deep.mkdir()
    (deep / "up").symlink_to(root / "train")  # a loop: a link to a folder above it
    (deep / "again").symlink_to(deep)  # a loop onto itself
    (root / "train" / "bee" / "cats").symlink_to(root / "train" / "cat")  # a second path to a class folder
    (root / "train" / "cat" / "twice.jpg").symlink_to(root / "train" / "cat" / "cat_000.JPEG")  # to a file
    (root / "val" / "cat" / "loop").symlink_to(root / "val")
    capsys.readouterr()
    recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={root}", "gpus=[]"))
    recipe.prepare()
    warned = capsys.readouterr().err.strip().splitlines()
    splits = scan(root)
    more = sorted(str(root / "train" / "ant" / "more" / p.name) for p in (elsewhere / "train" / "ant").iterdir())
    assert splits["train"].samples == sorted(real["train"] + [(p, 0) for p in more])
    assert len(splits["train"].samples) == 3 * 4 + 2 and splits["val"].samples == real["val"]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"launch: warning: data.root={root}: left out 5 linked paths") and \
        "3 loops" in warned[0] and str(deep / "again") in warned[0] and "2 second paths" in warned[0] and \
        str(root / "train" / "bee" / "cats") in warned[0], warned[0]


def test_a_class_folder_that_is_a_second_path_to_another_is_one_line(tmp_path):
    root = write_image_folder(tmp_path, 2, 1, odd_files=False)
    shutil.rmtree(root / "train" / "bee")
    (root / "train" / "bee").symlink_to(root / "train" / "cat")
    text = refusal(root)
    assert f"train/bee/ is {root / 'train' / 'cat'} again (a link; each class needs a folder of its own)" in text


def test_prepare_refuses_before_any_worker_and_writes_nothing_beside_the_data(folder, tmp_path):
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "gpus=[]"))
    recipe.prepare()
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    with pytest.raises(LaunchError, match="no such folder"):
        ImageFolder(config_of("recipe=imagefolder", f"data.root={tmp_path / 'none'}", "gpus=[]")).prepare()


def test_config_checks_the_model_and_sizes():
    with pytest.raises(LaunchError, match=r"recipe.model=resnet5 is not valid: a torchvision classification model, "
                                          r"e\.g\. .*resnet50.*list_models"):
        config_of("recipe=imagefolder", "recipe.model=resnet5")
    with pytest.raises(LaunchError, match="recipe.eval_resize=100 is not valid: must be 0"):
        config_of("recipe=imagefolder", "recipe.eval_resize=100")
    with pytest.raises(LaunchError, match="recipe.min_scale=0.0 is not valid"):
        config_of("recipe=imagefolder", "recipe.min_scale=0")
    cfg = config_of("recipe=imagefolder", "recipe.model=resnet18")
    assert cfg.recipe.eval_side == 256 and cfg.batch_size == 256 and cfg.perf.channels_last


# ---- the datasets -----------------------------------------------------------------------------------------


def split(folder, train=True, **kw) -> ImageFolderSplit:
    folders = scan(folder)
    ds = ImageFolderSplit(folders["train" if train else "val"], train=train, image_size=kw.pop("size", 32),
                          eval_resize=kw.pop("resize", 37), **kw)
    ds.set_epoch(kw.get("epoch", 0))
    return ds


def test_every_image_mode_becomes_an_rgb_uint8_crop(folder):
    ds = split(folder)
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == (3, 32, 32) and x.dtype == torch.uint8 and y == ds.targets[i]
    by_name = {Path(p).name: i for i, (p, _) in enumerate(ds.samples)}
    deep = ds[by_name["deep16.png"]][0]  # 16-bit grey: scaled to 8 bits, not clipped to white
    assert 20 < deep.float().mean() < 235 and torch.equal(deep[0], deep[1])
    assert torch.equal(ds[by_name["grey.jpg"]][0][0], ds[by_name["grey.jpg"]][0][2])


def test_transparent_pixels_become_the_mean_colour_which_normalizes_to_zero():
    from launcher.data.images import GREY_BACKGROUND

    clear = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # red, fully transparent
    rgb = torch.from_numpy(np.array(to_rgb(clear)))
    assert rgb.shape == (4, 4, 3) and torch.equal(rgb, torch.tensor(GREY_BACKGROUND, dtype=torch.uint8).expand(4, 4, 3))
    normalized = Normalizer(False)(rgb.permute(2, 0, 1)[None])
    assert normalized.abs().max() < 0.01
    half = torch.from_numpy(np.array(to_rgb(Image.new("RGBA", (2, 2), (255, 0, 0, 128))))).int()
    expected = (torch.tensor([255, 0, 0]) * 128 + torch.tensor(GREY_BACKGROUND) * 127) // 255  # half red, half mean
    assert (half[0, 0] - expected).abs().max() <= 1


def test_a_training_crop_is_torchvisions_random_resized_crop_and_flip_of_the_same_box(folder):
    """The CPU path's crop (torch's antialiased uint8 resize): torchvision's resized_crop of the same box on
    the PIL image, then the flip, to within a level or two of 255 at a few pixels."""
    from torchvision.transforms.v2 import functional as TF

    ds = split(folder, draft=False)
    for i in range(len(ds)):
        path = ds.samples[i][0]
        rng = ds._rng(i)
        with Image.open(path) as img:
            left, top, w, h = random_resized_crop_box(rng, *img.size, (ds.min_scale, 1.0))
            flip = rng.random() < 0.5
            ref = TF.pil_to_tensor(TF.resized_crop(to_rgb(img), top, left, h, w, [32, 32], antialias=True))
        ref = ref.flip(-1) if flip else ref
        diff = (ds[i][0].int() - ref.int()).abs()
        assert diff.float().mean() < 0.5 and diff.max() <= 8, (path, diff.float().mean(), diff.max())


def test_augmentation_repeats_for_the_same_seed_epoch_and_index_and_changes_with_them(folder):
    a, b = split(folder, seed=1), split(folder, seed=1)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(len(a)))
    b.set_epoch(1)
    assert sum(not torch.equal(a[i][0], b[i][0]) for i in range(len(a))) > len(a) // 2
    c = split(folder, seed=2)
    assert sum(not torch.equal(a[i][0], c[i][0]) for i in range(len(a))) > len(a) // 2


def test_without_set_epoch_each_pass_still_draws_new_crops(folder):
    ds = ImageFolderSplit(scan(folder)["train"], train=True, image_size=32, eval_resize=37)
    first = [ds[i][0] for i in range(6)]
    assert any(not torch.equal(first[i], ds[i][0]) for i in range(6))


def test_the_workers_of_a_dataloader_draw_the_same_crops_as_the_main_process(folder):
    ds = split(folder)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=collate,
                                         multiprocessing_context="fork")
    x = torch.cat([b[0] for b in loader])
    assert torch.equal(x, torch.stack([ds[i][0] for i in range(len(ds))]))


def test_evaluation_is_resize_then_center_crop_as_torchvision_does_it(folder):
    from torchvision.transforms import v2

    ds = split(folder, train=False, size=32, resize=40, draft=False)
    reference = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor()])
    for i in range(len(ds)):
        with Image.open(ds.samples[i][0]) as img:
            ref = reference(img.convert("RGB"))
        assert (ds[i][0].int() - ref.int()).abs().max() <= 1
    assert eval_geometry(300, 200, 256, 224) == (384, 256, 80, 16)
    # a centre between two pixels: torchvision rounds (259 - 200) / 2 = 29.5 to 30 (its CenterCrop)
    index = torch.arange(259 * 256).view(1, 259, 256)
    corner = int(v2.functional.center_crop(index, [200, 200])[0, 0, 0])
    assert eval_geometry(256, 259, 256, 200) == (256, 259, corner % 256, corner // 256) == (256, 259, 28, 30)
    assert split(folder, train=False)[0][0].shape == (3, 32, 32)


def test_jpeg_draft_decoding_changes_pixels_little(tmp_path):
    from tests.imagefolders import smooth_image

    rng = __import__("numpy").random.default_rng(0)
    path = tmp_path / "big.jpg"
    Image.fromarray(smooth_image(rng, 480, 360, 0)).save(path, quality=90)
    with Image.open(path) as a, Image.open(path) as b:
        drafted, full = decode_eval_crop(a, 64, 56, draft=True), decode_eval_crop(b, 64, 56, draft=False)
        assert a.size == (120, 90)  # decoded at 1/4 scale, still larger than the 85x64 it is resized to
    diff = (drafted.int() - full.int()).abs().float()
    assert drafted.shape == full.shape == (3, 56, 56) and diff.mean() < 2.0


# ---- bad files ----------------------------------------------------------------------------------------------


@pytest.fixture
def broken(tmp_path) -> Path:
    root = write_image_folder(tmp_path, 3, 1, odd_files=False)
    good = (root / "train" / "ant" / "ant_000.JPEG").read_bytes()
    (root / "train" / "ant" / "ant_001.JPEG").write_bytes(good[: len(good) // 2])  # truncated
    (root / "train" / "bee" / "bee_001.JPEG").write_bytes(b"not a jpeg at all")
    return root


@pytest.mark.parametrize("gpu_share", [0.0, 1.0])
def test_a_bad_file_stops_with_one_line_naming_it_or_is_skipped(broken, gpu_share):
    stops = split(broken, gpu_share=gpu_share)
    by_name = {Path(p).name: i for i, (p, _) in enumerate(stops.samples)}
    for name in ("ant_001.JPEG", "bee_001.JPEG"):
        with pytest.raises(BadImageError) as err:
            stops[by_name[name]]
        assert name in str(err.value) and "data.on_bad_file=skip" in str(err.value) and "\n" not in str(err.value)
    skips = split(broken, gpu_share=gpu_share, skip_bad=True)
    got = [skips[i] for i in range(len(skips))]
    assert [i for i, s in enumerate(got) if s is None] == sorted(by_name[n] for n in ("ant_001.JPEG", "bee_001.JPEG"))


def test_a_bad_file_raised_in_a_dataloader_worker_is_still_one_line(broken):
    loader = torch.utils.data.DataLoader(split(broken), batch_size=4, num_workers=1, collate_fn=collate,
                                         multiprocessing_context="fork")
    with pytest.raises(BadImageError) as err:
        list(loader)
    assert "\n" not in str(err.value) and "ant_001.JPEG cannot be decoded" in str(err.value)


def test_the_gpu_path_names_a_jpeg_nvjpeg_cannot_decode(broken, tmp_path):
    path = broken / "train" / "cat" / "cat_001.JPEG"
    data = bytearray(path.read_bytes())
    data[len(data) // 3: len(data) // 3 + 400] = b"\xff" * 400  # corrupt scan data, end marker kept
    path.write_bytes(bytes(data))
    ds = split(broken, gpu_share=1.0)
    rows = [i for i, (p, _) in enumerate(ds.samples) if "cat_00" in p]
    batch = collate([ds[i] for i in rows])
    assert isinstance(batch[-1], GpuWork) and len(batch[-1].jpegs) > 0
    try:
        x, y = gpu_batch(batch, 32, skip_bad=True, normalize=Normalizer(False))
    except BadImageError:
        pytest.fail("skip must not raise")
    assert len(x) in (len(rows), len(rows) - 1)  # (a decoder may also decode the damaged scan to noise)


def test_a_jpeg_the_gpu_cannot_decode_is_left_out_of_its_batch_with_its_label(folder, monkeypatch):
    """data.on_bad_file=skip: the batch the GPU finishes lacks that sample's row and its label, and the other
    rows are the ones a batch without it holds."""
    from launcher.data import gpu_decode

    ds = split(folder, train=False, gpu_share=1.0)
    batch = collate([ds[i] for i in range(len(ds))])
    jpegs = batch[3].jpegs
    whole, labels = gpu_batch(batch, 32, skip_bad=False, normalize=Normalizer(False))
    real = gpu_decode.decode_jpegs
    lost = 2  # (the third JPEG: the decoder gives no image for it)

    def one_lost(jpegs, device, skip_bad):
        images, bad = real(jpegs, device, skip_bad)
        return images[:lost] + images[lost + 1:], [*bad, lost]

    monkeypatch.setattr(gpu_decode, "decode_jpegs", one_lost)
    x, y = gpu_batch(batch, 32, skip_bad=True, normalize=Normalizer(False))
    kept = torch.ones(len(labels), dtype=torch.bool)
    kept[jpegs.rows[lost]] = False
    assert len(x) == len(y) == len(labels) - 1
    assert torch.equal(y, labels[kept])
    torch.testing.assert_close(x, whole[kept], atol=1e-4, rtol=0)  # (the canvas differs: float rounding)


# ---- the GPU path's code, on the CPU ----------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_batched_decode_and_roi_align_crops_match_the_cpu_path(folder, train):
    cpu = split(folder, train=train, draft=False)
    gpu = split(folder, train=train, gpu_share=1.0)
    batch = collate([gpu[i] for i in range(len(gpu))])
    pixels, labels, rows, work = batch
    jpegs = work.jpegs
    assert len(jpegs) >= len(gpu) - 6 and len(rows) + len(jpegs) == len(gpu)
    names = {Path(p).name for p in jpegs.paths}
    assert not names & {"grey.jpg", "cmyk.jpg", "palette.png", "deep16.png", "progressive.jpg", "alpha.PNG"}
    x, y = gpu_batch(batch, 32, skip_bad=False, normalize=Normalizer(False))
    x = x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)  # (back to 0..255)
    ref = torch.stack([cpu[i][0] for i in range(len(cpu))]).float()
    assert x.shape == ref.shape and x.dtype == torch.float32 and torch.equal(y, torch.tensor(cpu.targets))
    diff = (x - ref).abs()
    assert diff.mean() < 1.5 and diff.mean(dim=(1, 2, 3)).max() < 3.0  # (of 255)


@pytest.mark.parametrize("train", [True, False])
def test_crops_the_workers_decode_and_the_gpu_resizes_match_the_cpu_path(folder, train):
    """data.decode=gpu/auto where image_kernels runs: the workers decode each crop's pixels (at draft's
    reduced size) and hand them over unresized; the GPU resizes, flips, normalizes. The same crops as the
    CPU path's, up to the two resizes' rounding; every sample, whatever its file's format."""
    cpu = split(folder, train=train)
    regions = split(folder, train=train, regions=True)
    batch = collate([regions[i] for i in range(len(regions))])
    pixels, labels, rows, work = batch
    assert pixels.dim() == 1 and len(work.regions) == len(regions) and not len(work.jpegs)
    assert int(work.regions.shapes.prod(1).sum()) * 3 == pixels.numel()
    x, y = gpu_batch(batch, 32, skip_bad=False, normalize=Normalizer(False))
    x = x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
    ref = torch.stack([cpu[i][0] for i in range(len(cpu))]).float()
    assert x.shape == ref.shape and torch.equal(y, torch.tensor(cpu.targets))
    diff = (x - ref).abs()
    assert diff.mean() < 1.5 and diff.mean(dim=(1, 2, 3)).max() < 3.0, (diff.mean(), diff.mean(dim=(1, 2, 3)).max())


def test_regions_and_jpegs_travel_from_dataloader_workers_as_collated_in_process(folder):
    """A mixed batch (Regions, JPEGs for the GPU) made in DataLoader workers (its pixels in shared memory from
    the start) is the batch the main process would collate."""
    ds = split(folder, regions=True, gpu_share=0.5)
    loader = torch.utils.data.DataLoader(ds, batch_size=len(ds), num_workers=1, collate_fn=collate,
                                         multiprocessing_context="fork")
    (pixels, labels, rows, work), = list(loader)
    here = collate([ds[i] for i in range(len(ds))])
    assert len(work.jpegs) > 0 and len(work.regions) > 0 and len(work.jpegs) + len(work.regions) == len(ds)
    assert torch.equal(pixels, here[0]) and torch.equal(labels, here[1]) and torch.equal(rows, here[2])
    assert torch.equal(work.regions.boxes, here[3].regions.boxes) and work.jpegs.paths == here[3].jpegs.paths


def test_batches_of_regions_written_into_shared_slots_by_workers_train_as_the_same_batches_collated_here(folder):
    """A worker collates its batch of Regions into one of the split's PinnedSlots; the batch then carries the
    slot, not the bytes, and the training process reads them from there: the same images as a batch
    collated in the training process itself. A slot is free again once read."""
    from launcher.data.slots import PinnedSlots

    ds = split(folder, regions=True)
    ds.slots = PinnedSlots(workers=1, per_worker=2, nbytes=8 << 20)
    loader = torch.utils.data.DataLoader(ds, batch_size=len(ds), num_workers=1, collate_fn=collate,
                                         multiprocessing_context="fork")
    (pixels, labels, rows, work), = list(loader)
    assert pixels.numel() == 0 and work.regions.slot >= 0 and work.regions.nbytes > 0
    x, y = gpu_batch((pixels, labels, rows, work), 32, skip_bad=False, normalize=Normalizer(False), slots=ds.slots)
    assert int(ds.slots.busy[work.regions.slot]) == 0
    ref, ref_y = gpu_batch(collate([ds[i] for i in range(len(ds))]), 32, skip_bad=False, normalize=Normalizer(False))
    assert torch.equal(x, ref) and torch.equal(y, ref_y)


KERNEL_CHECK = """
import sys, torch
from launcher.data import image_kernels
from launcher.data.gpu_decode import Normalizer, gpu_batch
from launcher.data.images import collate
from tests.unit.test_imagefolder import split
from pathlib import Path
assert image_kernels.usable(torch.device("cpu"))
for train, regions in ((True, False), (False, False), (True, True), (False, True)):
    ds = split(Path(sys.argv[1]), train=train, gpu_share=1.0 if not regions else 0.5, regions=regions)
    batch = collate([ds[i] for i in range(len(ds))])
    assert len(batch[3].jpegs) > 0 and (len(batch[2]) > 0 or not train), "both kinds of sample in training"
    assert (batch[3].regions is not None) == regions
    x, y = gpu_batch(batch, 32, skip_bad=False, normalize=Normalizer(False))
    image_kernels.usable = lambda device: False
    ref, ref_y = gpu_batch(batch, 32, skip_bad=False, normalize=Normalizer(False))
    image_kernels.usable = lambda device: True
    assert torch.equal(y, ref_y) and x.shape == ref.shape
    print(train, float((x - ref).abs().max()))
    assert float((x - ref).abs().max()) < 1e-4
"""


def test_the_one_kernel_crops_flips_and_normalizes_as_the_torch_ops_do(folder, tmp_path):
    """recipe=imagefolder's Triton kernel (image_kernels), run by Triton's interpreter on the CPU, against the
    torch ops it replaces (roi_align on a canvas, flip, normalize): the same batch, both kinds of sample."""
    pytest.importorskip("triton", reason="the kernel needs triton (it comes with torch's CUDA builds)")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK, str(folder)], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") == 4


def test_on_after_batch_transfer_normalizes_both_kinds_of_batch(folder):
    recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "gpus=[]", "recipe.image_size=32"))
    train, _ = recipe.load()
    assert recipe.decode == "cpu" and recipe.num_classes(train) == 3
    plain = recipe.collate([train[i] for i in range(8)])
    x, y = recipe.on_after_batch_transfer(plain, training=True)
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and -3 < x.mean() < 3 and y.dtype == torch.int64
    gpu = split(folder, gpu_share=1.0)
    mixed = recipe.collate([gpu[i] for i in range(len(gpu))])
    x2, y2 = recipe.on_after_batch_transfer(mixed, training=True)
    assert x2.shape == (len(gpu), 3, 32, 32) and -3 < x2.mean() < 3
    regions = split(folder, regions=True)
    unresized = recipe.collate([regions[i] for i in range(len(regions))])
    x3, y3 = recipe.on_after_batch_transfer(unresized, training=True)
    assert x3.shape == (len(regions), 3, 32, 32) and -3 < x3.mean() < 3
    assert torch.equal(y3, torch.tensor(regions.targets))


def test_decode_gpu_without_cuda_says_so_and_decodes_on_the_cpu(folder, caplog):
    recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "gpus=[]", "data.decode=gpu",
                                   "data.workers=2"))
    with caplog.at_level("INFO", logger="launcher.train"):
        assert recipe.decode_plan(cuda=False) == ("cpu", 0.0)
        assert recipe.decode_plan(cuda=True) == ("gpu", 1.0)
    assert "no CUDA device here; the DataLoader workers decode the images instead" in caplog.text
    for workers, said in (("0", "the training process decodes (data.workers=0)"), ("2", "the DataLoader workers")):
        caplog.clear()
        on_cpu = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "gpus=[]", "data.decode=auto",
                                       f"data.workers={workers}"))
        with caplog.at_level("INFO", logger="launcher.train"):
            assert on_cpu.decode_plan(cuda=False) == ("cpu", 0.0)
        assert f"data.decode=auto: no CUDA device, so {said}" in caplog.text
    auto = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "data.decode=auto", "data.workers=15"))
    with caplog.at_level("INFO", logger="launcher.train"):
        mode, share = auto.decode_plan(cuda=True)
    assert (mode, share) == ("auto", 0.0)
    assert "decoded by the 15 DataLoader workers alone (PIL) and timed; if the workers do not keep up" in caplog.text
    ds = split(folder, gpu_share=0.3)  # (a split: the samples for the GPU drawn by index, about the share)
    on_gpu = sum(ds._on_gpu(i) for i in range(1000))
    assert abs(on_gpu / 1000 - 0.3) < 0.06


class Timeline:
    """Training batches reaching a DecodeTrial: each `gap` seconds after the one before, while the GPU's steps
    take `step` seconds each on its own clock (the loop's StepPace; the gap unless said), the prefetch thread
    is held `held` seconds a batch, and the 15 workers make samples at `rate` img/s in all (busy all the time)."""

    def __init__(self, splits, monkeypatch):
        from launcher.data import decode_trial

        self.trial, self.splits, self.now, self.step = None, splits, [0.0], None
        monkeypatch.setattr(decode_trial.time, "perf_counter", lambda: self.now[0])

    def pace(self, n: int) -> float | None:
        return self.step

    def batches(self, n: int, gap: float, gpu: int, rate: float = 0.0, step: float | None = None,
                held: float = 0.0) -> None:
        self.step = gap if step is None else step
        for _ in range(n):
            self.now[0] += gap
            self.splits[0]._work[:15] += torch.tensor([rate * gap / 15, gap])
            self.trial.batch(256, gpu_samples=gpu, held_s=held)

    def candidate(self, gap: float, gpu: int, rate: float, stale: int = 0, step: float | None = None,
                  held: float = 0.0) -> None:
        """One candidate's turn: `stale` batches made under the candidate before (not counted), its first
        SETTLE (not timed), then MEASURE + 1 (timed)."""
        from launcher.data.decode_trial import DecodeTrial

        self.batches(stale, 5.0, 0 if gpu else 190)
        self.batches(DecodeTrial.SETTLE, 9.0, gpu)
        self.batches(DecodeTrial.MEASURE + 1, gap, gpu, rate, step, held)


def trial_of(folder, monkeypatch, paced: bool = True, **kw):
    from launcher.data.decode_trial import DecodeTrial

    splits = (split(folder, gpu_share=0.3), split(folder, train=False, gpu_share=0.3))
    timeline = Timeline(splits, monkeypatch)
    timeline.trial = trial = DecodeTrial(splits, pace=timeline.pace if paced else None, **kw)
    return trial, splits, timeline


def test_decode_auto_keeps_workers_that_keep_up_without_trying_a_split(folder, monkeypatch, caplog):
    """data.decode=auto: the workers alone first, timed by the steps' own time on the GPU, by the time its
    workers need for a batch and by the prefetch thread's; where the workers need no longer than a step,
    nothing else is tried."""
    trial, splits, time_ = trial_of(folder, monkeypatch)
    assert splits[0].gpu_share == splits[1].gpu_share == 0.0  # the workers alone, from the first batch
    assert all(s._gpu_share.is_shared() and s._work.is_shared() for s in splits)
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.040, 0, 11_000.0, held=0.0012)  # steps 40 ms, the workers 23.3 ms a batch
    assert trial.done and trial.candidates == [0.0] and splits[0].gpu_share == 0.0
    assert ("kept the workers alone (a training batch every, over 24 batches after the first 8: the workers alone "
            "40.0 ms (steps 40.0, workers 23.3, prefetch thread 1.2))") in caplog.text
    trial.batch(256, gpu_samples=0)  # done: nothing changes any more
    assert splits[0].gpu_share == 0.0


def test_decode_auto_sizes_a_split_from_workers_that_fall_behind_and_keeps_it_where_faster(folder, monkeypatch,
                                                                                          caplog):
    """The workers alone need 55 ms a batch where the steps (fed from their stock) take 37.8: they make 69% of a
    batch in a step's time, 65% with the margin, so the GPU is given 35%. That split's steps take 40 ms and its
    workers 40.5: close enough, no third try; it is faster than 55 ms and kept on both splits."""
    trial, splits, time_ = trial_of(folder, monkeypatch)
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.0378, 0, 256 / 0.055)
        assert not trial.done and trial.candidates == [0.0, 0.35] and splits[0].gpu_share == 0.35
        assert splits[1].gpu_share == 0.0  # (evaluation: the workers alone until the trial ends)
        time_.candidate(0.040, 90, 256 / 0.0405, stale=30, held=0.012)  # (30 batches the workers had made alone)
    assert trial.done and splits[0].gpu_share == splits[1].gpu_share == 0.35
    assert ("kept 35% on the GPU (a training batch every, over 24 batches after the first 8: the workers alone 55.0 ms "
            "(steps 37.8, workers 55.0, prefetch thread 0.0), 35% on the GPU 40.5 ms (steps 40.0, workers 40.5, "
            "prefetch thread 12.0))") in caplog.text


def test_decode_auto_times_the_steps_on_the_gpus_clock_not_by_the_gaps_between_batches(folder, monkeypatch,
                                                                                       caplog):
    """The host runs ahead of the GPU and catches up in bursts, so the gaps between batches reaching the
    prefetch thread are not the steps (on two H200s their median said 22.9 to 70.7 ms for 38 ms steps, and a
    split was tried beside workers that kept up). The steps are their own time on the GPU's clock."""
    trial, splits, time_ = trial_of(folder, monkeypatch)
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.0229, 0, 256 / 0.0372, step=0.038)  # the workers' 37.2 ms keep up with 38 ms steps
    assert trial.done and trial.candidates == [0.0] and "(steps 38.0, workers 37.2," in caplog.text
    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.0707, 0, 256 / 0.055, step=0.038)  # behind: the split sized from 38 ms, not 70.7
    assert trial.candidates == [0.0, 0.34]  # 1 - 38 / 55 x 0.95
    # the prefetch thread held longer than a step: a floor no split lowers; workers within it are kept
    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.045, 0, 256 / 0.044, step=0.040, held=0.045)
    assert trial.done and trial.candidates == [0.0]


def test_decode_auto_without_the_loops_step_pace_times_the_steps_by_their_median_gap(folder, monkeypatch):
    """Driven by hand (no StepPace from the loop), the steps are the median gap between batches: a compile
    among them (a few gaps of seconds among 40 ms steps) does not count."""
    from launcher.data.decode_trial import DecodeTrial

    trial, splits, time_ = trial_of(folder, monkeypatch, paced=False)
    time_.batches(DecodeTrial.SETTLE, 9.0, 0)
    time_.batches(3, 12.0, 0, 256 / 0.048)  # compiling, capturing
    time_.batches(DecodeTrial.MEASURE - 2, 0.040, 0, 256 / 0.048)
    assert trial.results[0][1] == pytest.approx(0.040) and trial.results[0][2] == pytest.approx(0.048, rel=1e-3)
    assert trial.candidates == [0.0, 0.21] and splits[0].gpu_share == 0.21  # 1 - 40 / 48 x 0.95


def test_decode_auto_balances_a_split_once_more_and_keeps_the_fastest_or_the_workers_on_a_tie(folder, monkeypatch,
                                                                                            caplog):
    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.040, 0, 256 / 0.084)  # the workers alone 84 ms a batch: the GPU gets 1 - 40 / 84 x 0.95
    assert trial.candidates == [0.0, 0.55]
    time_.candidate(0.050, 141, 256 / 0.030)  # the split's workers idle beside slower steps: they get more back,
    assert trial.candidates == [0.0, 0.55, 0.29] and not trial.done  # 1 - 0.45 x 50 / 30 x 0.95
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.045, 74, 256 / 0.044)
    assert trial.done and len(trial.candidates) == 3 and splits[0].gpu_share == 0.29  # 45 ms: the fastest
    assert ("kept 29% on the GPU" in caplog.text
            and "55% on the GPU 50.0 ms (steps 50.0, workers 30.0, prefetch thread 0.0)" in caplog.text)
    # the workers alone win a tie within 2%
    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.040, 0, 256 / 0.0500)
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.0495, 60, 256 / 0.0495)
    assert trial.done and splits[0].gpu_share == 0.0 and "kept the workers alone" in caplog.text


def test_decode_auto_balances_the_workers_against_a_gpu_decoder_that_holds_the_prefetch_thread(folder, monkeypatch,
                                                                                              caplog):
    """The split's GPU decoding holds the prefetch thread 60 ms a batch for 55% of it (109 ms for a whole
    batch) while the workers need 84 ms for one: no share keeps both within the 40 ms step, so the next split
    is where they take as long (84 / (84 + 109) on the GPU), and the faster of the three is kept."""
    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.040, 0, 256 / 0.084)
    assert trial.candidates == [0.0, 0.55]
    time_.candidate(0.060, 141, 256 / 0.0378, step=0.040, held=0.060)
    assert trial.candidates == [0.0, 0.55, 0.44] and not trial.done
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.candidate(0.048, 113, 256 / 0.047, step=0.041, held=0.048)
    assert trial.done and splits[0].gpu_share == 0.44
    assert "kept 44% on the GPU" in caplog.text and "(steps 40.0, workers 37.8, prefetch thread 60.0)" in caplog.text


def test_decode_auto_keeps_the_workers_where_no_batch_comes_for_the_gpu(folder, monkeypatch, caplog):
    """A folder the GPU decoder cannot take (PNGs): no batch is ever made under the split; after GIVE_UP
    batches the trial ends with the workers alone."""
    from launcher.data.decode_trial import DecodeTrial

    trial, splits, time_ = trial_of(folder, monkeypatch)
    time_.candidate(0.040, 0, 256 / 0.060)
    assert trial.candidates[1] > 0
    with caplog.at_level("INFO", logger="launcher.train"):
        time_.batches(DecodeTrial.GIVE_UP, 0.04, 0)
    assert trial.done and splits[0].gpu_share == 0.0 and "kept the workers alone" in caplog.text


def test_decode_auto_times_the_second_epochs_batches_not_the_first_ones(folder, monkeypatch, caplog):
    trial, splits, time_ = trial_of(folder, monkeypatch, start_after=40)
    time_.batches(40, 0.040, 0, 1_000.0)  # the first epoch's: not timed, however slow the workers
    time_.candidate(0.040, 0, 11_000.0)
    assert trial.done and trial.candidates == [0.0]
    for compile_, epochs, said in (("auto", 2, True), ("true", 2, True), ("false", 3, True), ("auto", 1, False)):
        recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "data.workers=15",
                                       f"perf.compile={compile_}", f"epochs={epochs}"))
        caplog.clear()
        with caplog.at_level("INFO", logger="launcher.train"):
            recipe.decode_plan(cuda=True)
        assert ("the first training batches of the second epoch (the first one's pace is not the run's" in
                caplog.text) == said


def test_the_loader_feeds_a_training_datasets_trial_however_the_recipe_nests_its_batches(folder):
    """data.decode=auto's trial is fed by the data path, not by the recipe: the loader times the recipe's
    on_after_batch_transfer for each training batch, finds the samples a batch leaves to the GPU wherever the
    recipe's collate puts them, and hands the trial the split's step pace (which the loop's StepClock fills);
    an evaluation split feeds nothing."""
    from launcher.config import DataConfig
    from launcher.data.decode_trial import DecodeTrial
    from launcher.data.loader import DatasetSplit
    from launcher.data.placement import rank_order
    from launcher.recipes import Recipe

    class Nested(Recipe):  # (a user's recipe: its batches a dict around the image folder's)
        def __init__(self):
            pass

        def collate(self, samples):
            return {"images": collate(samples), "count": torch.tensor(len(samples))}

        def on_after_batch_transfer(self, batch, training):
            return batch

    train, val = split(folder, gpu_share=1.0), split(folder, train=False)
    trial = DecodeTrial((train, val))  # (the workers alone first: the share set back to 0)
    options = DataConfig(workers=0)
    training = DatasetSplit(train, Nested(), options, torch.device("cpu"), True, 1, 0, 1, 4)
    assert trial.pace == training.pace.median_s and trial.pace(1) is None
    rows = rank_order(len(train), 4, seed=0, epoch=0)
    assert len(list(training.batches(rows[:3], 0))) == 3
    assert (trial.seen, trial.made, trial.waited) == (3, 3, 0)  # made under the workers alone
    train.gpu_share = 1.0  # (JPEGs left to the GPU: batches of another share than the trial's candidate)
    batches = list(training.batches(rows[3:5], 0))
    assert all(len(b["images"][3].jpegs) > 0 for b, _ in batches)
    assert (trial.seen, trial.made, trial.waited) == (5, 3, 2)
    evaluation = DatasetSplit(val, Nested(), options, torch.device("cpu"), False, 1, 0, 1, 4)
    assert evaluation.trial is None and evaluation.pace is None


def test_a_share_set_in_the_launchers_process_reaches_the_running_workers(folder):
    """The auto trial changes the share while persistent, forked DataLoader workers read samples."""
    ds = split(folder, gpu_share=1.0)
    ds.share_with_workers()  # (as DecodeTrial does, before the workers start)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, collate_fn=collate,
                                         multiprocessing_context="fork")
    first = next(iter(loader))
    assert len(first) == 4 and len(first[3].jpegs) > 0  # JPEGs left for the GPU
    ds.gpu_share = 0.0
    kinds = [len(b) for b in loader]  # (the same workers, a new pass)
    assert set(kinds) == {2}  # every sample decoded by the workers
    work = ds.work()  # what each worker made, and the seconds it spent, seen here
    assert work[:2, 0].sum() >= len(ds) + 4 and (work[:2, 0] > 0).all() and (work[:2, 1] > 0).all()
    assert work[2:].sum() == 0  # (no other worker, nothing read in this process)


def test_the_model_is_torchvisions_untrained(folder):
    recipe = ImageFolder(config_of("recipe=imagefolder", "recipe.model=resnet18", "gpus=[]"))
    model = recipe.build_model(3)
    assert model.fc.out_features == 3
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


def test_decode_auto_splits_the_batch_for_the_workers_this_rank_gets(folder, monkeypatch, caplog):
    """data.workers unset: the CPU's share of each batch follows the workers the launcher gives each rank (the
    cores shared by the ranks on the machine), not every core (2 ranks on 32 cores: 15 each, not 31)."""
    from launcher.data import loader

    cfg = config_of("recipe=imagefolder", f"data.root={folder}")
    for local in ("1", "2", "4"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert loader.rank_workers(cfg.data) == loader.default_workers(int(local))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    recipe = ImageFolder(cfg)
    assert loader.rank_workers(cfg.data) == 15
    with caplog.at_level("INFO", logger="launcher.train"):
        assert recipe.decode_plan(cuda=True) == ("auto", 0.0)
    assert "decoded by the 15 DataLoader workers alone" in caplog.text


def test_the_batch_slots_fit_the_hosts_memory_and_dev_shm_or_are_left_out(folder, monkeypatch, caplog):
    """ImageFolder.batch_slots: each worker's prefetch plus two slots of two batches of crops, within a quarter of
    the host's memory and half of /dev/shm's free space (a write past a small /dev/shm would kill a worker)."""
    import os as real_os

    recipe = ImageFolder(config_of("recipe=imagefolder", f"data.root={folder}", "gpus=[]", "data.workers=3",
                                   "batch_size=8", "recipe.image_size=32"))
    slots = recipe.batch_slots()
    assert (slots.workers, slots.per_worker, slots.nbytes) == (3, 4 + 2, 2 * 8 * 32 * 32 * 3)

    class Small:
        f_bavail, f_frsize = 4, 4096  # 16 KB free

    monkeypatch.setattr(real_os, "statvfs", lambda path: Small())
    with caplog.at_level("INFO", logger="launcher.train"):
        assert recipe.batch_slots() is None
    assert "no shared batch slots" in caplog.text and "\n" not in caplog.text.strip()
