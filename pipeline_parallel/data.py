"""The images the master trains on. The tutorial draws random images and random labels, which
leave nothing to learn; here every class has an image of its own (a smooth random pattern of
colours), and each sample is its class's image under pixel noise, so the loss can fall."""

import torch
import torch.nn.functional as F

NUM_CLASSES = 10
NOISE = 0.5


def class_images(num_batches, batch_size, image_size, seed):
    """num_batches batches of (images, class indices), the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(NUM_CLASSES, 3, 4, 4, generator=gen),
                             size=image_size, mode="bilinear", align_corners=False)
    for _ in range(num_batches):
        labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen)
        noise = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
        yield patterns[labels] + NOISE * noise, labels
