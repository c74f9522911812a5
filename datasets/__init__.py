"""On-disk formats and Datasets: the data families (Taskonomy, digits, CIFAR, a user's own folders: imagefolder and
paired_folders), the synthetic renderer, step-1 selection, the decoded cache.

The modules are imported explicitly (no discovery magic); importing a family
module registers it in :data:`datasets.family.DATASETS`. Note that this package
shadows Hugging Face ``datasets`` for scripts run from the repository root.
"""

from datasets import cache, family, taskonomy, digits, cifar, imagefolder, paired_folders, synthetic, selection  # noqa: F401
