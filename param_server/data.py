"""The data the trainers train on: MNIST through torchvision, as in the tutorial, or, offline,
generated digits of the same shape; and each trainer's share of it."""

import contextlib
import io
import itertools
import socket
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

# <repo>/data, wherever the command runs from (the tutorial's '../data' depends on that).
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

# Seven-segment shapes for the synthetic digits: segment -> (top, left, bottom, right) pixels.
SEGMENTS = {"a": (5, 9, 6, 19), "b": (5, 18, 14, 19), "c": (14, 18, 23, 19),
            "d": (22, 9, 23, 19), "e": (14, 9, 23, 10), "f": (5, 9, 14, 10), "g": (13, 9, 14, 19)}
DIGIT_SEGMENTS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc",
                  "abcdefg", "abcdfg")
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE = 6000, 1000


def synthetic_digits(size, seed):
    """MNIST-shaped stand-in for MNIST when it cannot be downloaded: digits drawn as
    seven-segment shapes, randomly rotated, scaled, shifted and blurred, with pixel noise, then
    normalised with MNIST's mean and deviation. Deterministic for a given seed, and learnable
    (each class has its own shape), so accuracy means something."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.zeros(10, 1, 28, 28)
    for digit, segments in enumerate(DIGIT_SEGMENTS):
        for segment in segments:
            top, left, bottom, right = SEGMENTS[segment]
            templates[digit, 0, top:bottom + 1, left:right + 1] = 1.0
    labels = torch.randint(0, 10, (size,), generator=gen)
    angle = (torch.rand(size, generator=gen) - 0.5) * 0.5  # up to about 15 degrees
    scale = 0.85 + 0.3 * torch.rand(size, generator=gen)
    shift = (torch.rand(size, 2, generator=gen) - 0.5) * 0.3
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1),
                         torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, [size, 1, 28, 28], align_corners=False)
    images = F.grid_sample(templates[labels], grid, align_corners=False)
    images = F.avg_pool2d(images, 3, stride=1, padding=1)
    noise = 0.15 * torch.randn(size, 1, 28, 28, generator=gen)
    images = (1.5 * images + noise).clamp(0, 1)
    return TensorDataset((images - MNIST_MEAN) / MNIST_STD, labels)


def mnist(data_dir, train, download=False):
    from torchvision import datasets, transforms  # only trainers need torchvision

    transform = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    return datasets.MNIST(data_dir, train=train, download=download, transform=transform)


def check_mnist(data_dir):
    """Make sure MNIST is in data_dir, downloading it if it is not; None if it is there, else a
    one-line explanation: what is missing, or which file torchvision could not read. Runs once,
    before any rank starts."""
    raw = Path(data_dir) / "MNIST" / "raw"
    missing = [name for name in MNIST_FILES if not (raw / name).exists()]
    try:
        # torchvision prints each mirror it tries; keep that out of the output, and bound each
        # attempt, so that an offline machine gets one line, quickly.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            previous_timeout = socket.getdefaulttimeout()
            socket.setdefaulttimeout(30)
            try:
                mnist(data_dir, train=True, download=True)
                mnist(data_dir, train=False, download=True)
            finally:
                socket.setdefaulttimeout(previous_timeout)
    except Exception as err:  # noqa: BLE001 - any failure here is the data's, said in one line
        if missing:
            return (f"MNIST is not in {raw} (expected {', '.join(missing)}) and could not be "
                    "downloaded; copy the files there, or run with --dataset synthetic")
        message = str(err).splitlines()[0] if str(err) else ""
        return (f"MNIST in {raw} is damaged: torchvision cannot read it ({type(err).__name__}: "
                f"{message}); copy its four files there again, or run with --dataset synthetic")
    return None


def get_data_loaders(rank, world_size, args):
    """This trainer's share of the training set (every (world_size-1)th sample, so that an epoch
    of all trainers together is one pass over the data) and the whole test set."""
    if args.dataset == "synthetic":
        train_set = synthetic_digits(SYNTHETIC_TRAIN_SIZE, args.seed)
        test_set = synthetic_digits(SYNTHETIC_TEST_SIZE, args.seed + 1)
    else:
        train_set = mnist(args.data_dir, train=True)
        test_set = mnist(args.data_dir, train=False)
    shard = Subset(train_set, range(rank - 1, len(train_set), world_size - 1))
    train_loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed + rank))
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False)
    return train_loader, test_loader


def equal_share_batches(train_loader, num_trainers, args):
    """Batches per epoch for every trainer: the most that the smallest share holds (shares
    differ by a sample at most), at most --max_batches."""
    smallest_share = len(train_loader.dataset.dataset) // num_trainers
    return min(-(-smallest_share // args.batch_size), args.max_batches or smallest_share)


class Epochs:
    """main.py's training loader: --epochs passes over a trainer's share (`loader`), each cut
    at --max_batches batches, as one loader, so that the tutorial's loop over one loader trains
    as long as the flags say."""

    def __init__(self, loader, epochs, max_batches):
        self.loader = loader
        self.dataset = loader.dataset
        self.epochs = epochs
        self.batches = min(len(loader), max_batches or len(loader))

    def __len__(self):
        return self.epochs * self.batches

    def __iter__(self):
        for _ in range(self.epochs):
            yield from itertools.islice(self.loader, self.batches)


def get_training_data(rank, world_size, args):
    """main.py's trainer's data: its loader of every epoch (Epochs), and the test loader."""
    train_loader, test_loader = get_data_loaders(rank, world_size, args)
    return Epochs(train_loader, args.epochs, args.max_batches), test_loader
