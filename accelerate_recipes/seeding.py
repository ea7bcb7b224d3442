"""Random augmentation that a resumed run repeats exactly.

Transforms that draw from torch's global generator make an image's augmentation depend on everything
drawn before it: how many loader workers there are, and that accelerate's loader reads one batch
ahead (so a checkpoint's RNG state already includes the next batch's draws). Drawing instead from a
generator seeded by (seed, epoch, index) gives each image the same augmentation in an uninterrupted
run, a resumed one, or with any number of workers.
"""

import torch
from torch.utils.data import Dataset


class SeededAugmentation(Dataset):
    """Wraps a dataset whose __getitem__ draws from torch's global generator (torchvision
    transforms, ...).

    Call `set_epoch(epoch)` before each epoch. The epoch lives in shared memory, so persistent
    DataLoader workers see it.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):  # the global generator is put back afterwards
            torch.manual_seed(hash((self.seed, int(self._epoch), int(index))) & (2**63 - 1))
            return self.dataset[index]

    def __getattr__(self, name):  # classes, targets, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
