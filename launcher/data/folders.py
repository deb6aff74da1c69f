"""A folder of classes in the ImageNet layout, scanned and checked before any worker starts (no torch).

    ROOT/train/<class>/<file>      (subfolders of a class folder count too, as in torchvision)
    ROOT/val/<class>/<file>

Linked folders are followed, each folder and file read once per split: a link back to a folder above it
and a second path to what was read already are left out, said in one line (`left_out_line`, _SplitWalk).

Images are the files ending .jpg .jpeg .png .bmp .webp (any case); other files and hidden ones (a name
starting with a dot: .DS_Store, ._x.jpg, .ipynb_checkpoints/) are ignored. Classes are the class folders'
names, sorted; samples are sorted like torchvision's ImageFolder, so indices and labels match it.

`scan` reads directory entries only (os.scandir; no file is opened): each problem is one line naming
data.root, exit 2. It imports no torch, so the launcher can run it (a recipe's `prepare`) before any worker.
"""

from __future__ import annotations

import os
import stat as stat_module
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SPLITS = ("train", "val")
EXAMPLE = "recipe=imagefolder data.root=/data/imagenet"

def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)


def _class_folders(split: Path) -> list[str]:
    with os.scandir(split) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


@dataclass
class LeftOut:
    """The linked paths a split's scan did not follow: loops (a link to the folder it is in or to one above
    it) and second paths to a folder or image read already (under its real path, kept)."""

    loops: list[str] = field(default_factory=list)
    again: list[tuple[str, str]] = field(default_factory=list)  # (the path left out, the path it was read under)

    def __len__(self) -> int:
        return len(self.loops) + len(self.again)


class _SplitWalk:
    """One split's class folders listed as os.walk(followlinks=True) lists them, but each folder and image read
    once. os.walk followed a link to a folder above it 40 levels deep (12 images read as 492 samples; two such
    links never end), and read a second path to a folder or file again. Here the real folders come first, then
    the links found in them (round after round: links inside linked folders); a linked folder already read
    (by device and inode) or a linked image whose real path was read is left out, in `left_out`."""

    def __init__(self, split: Path):
        self.dirs: dict[tuple[int, int], str] = {}  # each folder read (device, inode) -> the path read
        self.names: dict[tuple[int, int], set[str]] = {}  # the images read in each folder, by its identity
        self.linked_files: set[str] = set()  # real paths of the images read through a link
        self.found: dict[str, tuple[int, list[str]]] = {}  # folder path -> (class index, its images' names)
        self.links: list[tuple[int, str]] = []  # (class index, path) of the links the next round follows
        self.left_out = LeftOut()
        self.roots_left: dict[int, str] = {}  # a class folder that is itself left out -> the path it leads to
        st = os.stat(split)
        self.dirs[(st.st_dev, st.st_ino)] = str(split)  # (a link to the split itself is a loop)

    def run(self, roots: list[tuple[int, str]]) -> list[list[str]]:
        """The image paths of each class (index order), sorted as torchvision's ImageFolder sorts them: folder
        by folder in sorted order of the folders' paths, each folder's files by name."""
        for label, path in sorted(roots, key=lambda r: os.path.islink(r[1])):  # real class folders first
            self._enter(label, path, root=True)
        while self.links:
            pending, self.links = sorted(self.links, key=lambda r: r[1]), []
            files = []
            for label, path in pending:  # linked folders of this round first, then linked files
                try:
                    st = os.stat(path)
                except OSError:  # dangling, or a link to itself: a file as os.walk lists it (named when read)
                    st = None
                if st is not None and stat_module.S_ISDIR(st.st_mode):
                    self._enter(label, path)
                else:
                    files.append((label, path))
            for label, path in files:
                self._linked_file(label, path)
        per_class: list[list[str]] = [[] for _ in roots]
        for folder, (label, names) in sorted(self.found.items()):
            per_class[label].extend(os.path.join(folder, name) for name in sorted(names))
        return per_class

    def _enter(self, label: int, top: str, root: bool = False) -> None:
        """Read the folder `top` and the real folders under it; the links in them wait for the next round."""
        stack = [top]
        while stack:
            folder = stack.pop()
            st = os.stat(folder)
            key = (st.st_dev, st.st_ino)
            first = self.dirs.get(key)
            if first is not None:
                real, parent = os.path.realpath(folder), os.path.realpath(os.path.dirname(folder))
                if parent == real or parent.startswith(real.rstrip(os.sep) + os.sep):
                    self.left_out.loops.append(folder)
                else:
                    self.left_out.again.append((folder, first))
                if root:
                    self.roots_left[label] = first
                continue
            self.dirs[key] = folder
            names: list[str] = []
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name.startswith("."):
                        continue
                    if e.is_symlink():
                        self.links.append((label, e.path))
                    elif e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif _is_image(e.name):
                        names.append(e.name)
            self.names[key] = set(names)
            self.found[folder] = (label, names)

    def _linked_file(self, label: int, path: str) -> None:
        """A link to a file: an image unless its target was read already (really there, or through a link)."""
        folder, name = os.path.split(path)
        if not _is_image(name):
            return
        real = os.path.realpath(path)
        try:
            st = os.stat(os.path.dirname(real))
            there = os.path.basename(real) in self.names.get((st.st_dev, st.st_ino), ())
        except OSError:
            there = False
        if there or real in self.linked_files:
            self.left_out.again.append((path, real))
            return
        self.linked_files.add(real)
        self.found[folder][1].append(name)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


@dataclass
class Folder:
    """One split: its classes (sorted folder names) and samples (path, class index), in ImageFolder's order."""

    classes: list[str]
    samples: list[tuple[str, int]]
    left_out: LeftOut = field(default_factory=LeftOut)  # linked paths not followed (loops, second paths)


def scan(root: Path) -> dict[str, Folder]:
    """Both splits of `root`, checked: a ConfigError naming data.root and the problem, one line each. Reads
    directory entries only (os.scandir; no image is opened): quick even for a large folder on a local disk
    (measured: BENCHMARKS.md section 12)."""
    key = "data.root"
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "no such folder"
        raise ConfigError(key, root, f"{what}: recipe=imagefolder reads DIR/train/<class>/<image> and "
                          "DIR/val/<class>/<image> (the ImageNet layout)", EXAMPLE)
    for split in SPLITS:
        if not (root / split).is_dir():
            with os.scandir(root) as entries:
                there = sorted(e.name + ("/" if e.is_dir() else "") for e in entries if not e.name.startswith("."))
            held = f"it holds {_listing(there)}" if there else "it is empty"
            hint = " (torchvision's ImageNet val/ comes flat: sort it into val/<class>/ folders first)" \
                if split == "val" else ""
            raise ConfigError(key, root, f"has no {split}/ folder ({held}); recipe=imagefolder needs train/<class>/"
                              f"<image> and val/<class>/<image>{hint}", EXAMPLE)
    folders: dict[str, Folder] = {}
    for split in SPLITS:
        classes = _class_folders(root / split)
        if not classes:
            with os.scandir(root / split) as entries:
                loose = any(e.is_file() and _is_image(e.name) for e in entries)
            what = "holds images but no class folders: put each class's images in" if loose else \
                "holds no class folders: put each class's images in"
            raise ConfigError(key, root, f"{split}/ {what} {split}/<class>/", EXAMPLE)
        try:
            walk = _SplitWalk(root / split)
            per_class = walk.run([(i, str(root / split / name)) for i, name in enumerate(classes)])
        except OSError as exc:  # (os.walk passed over a folder it could not list: its images went missing)
            raise ConfigError(key, root, f"cannot list {exc.filename or split} ({exc.strerror or exc}): make it "
                              "readable, or move it out of data.root", EXAMPLE) from None
        samples: list[tuple[str, int]] = []
        for index, (name, files) in enumerate(zip(classes, per_class, strict=True)):
            if not files and index in walk.roots_left:
                raise ConfigError(key, root, f"{split}/{name}/ is {walk.roots_left[index]} again (a link; each "
                                  "class needs a folder of its own): remove the link, or make it a folder of that "
                                  "class's images", EXAMPLE)
            if not files:
                raise ConfigError(key, root, f"{split}/{name}/ holds no images (files ending "
                                  f"{' '.join(IMAGE_SUFFIXES)}, any case): add some or remove the folder", EXAMPLE)
            samples.extend((f, index) for f in files)
        folders[split] = Folder(classes, samples, walk.left_out)
    train, val = folders["train"].classes, folders["val"].classes
    if train != val:
        only_train = sorted(set(train) - set(val))
        only_val = sorted(set(val) - set(train))
        parts = ([f"only in train/: {_listing(only_train)}"] if only_train else []) + \
            ([f"only in val/: {_listing(only_val)}"] if only_val else [])
        raise ConfigError(key, root, "train/ and val/ must hold the same class folders (a class's index is its "
                          f"place in their sorted names); {'; '.join(parts)}", EXAMPLE)
    if len(train) < 2:  # (one class: every prediction is right; it trained to "100%" in silence)
        raise ConfigError(key, root, f"holds one class only ({train[0]}/): a classifier needs two or more class "
                          "folders in train/ and val/, one per class", EXAMPLE)
    return folders


def left_out_line(root: Path, folders: dict[str, Folder]) -> str | None:
    """One line saying which linked paths the scan of both splits left out (counts and an example of each
    kind), or None where it followed every link."""
    loops = [p for f in folders.values() for p in f.left_out.loops]
    again = [pair for f in folders.values() for pair in f.left_out.again]
    if not loops and not again:
        return None
    parts = ([f"{len(loops)} loop{'s' if len(loops) != 1 else ''} (a link to the folder it is in or one above "
              f"it, e.g. {loops[0]})"] if loops else []) + \
        ([f"{len(again)} second path{'s' if len(again) != 1 else ''} to a folder or image read already (e.g. "
          f"{again[0][0]}, which is {again[0][1]})"] if again else [])
    return (f"data.root={root}: left out {len(loops) + len(again)} linked paths, so that each image is one sample: "
            f"{'; '.join(parts)}")

