"""On-disk formats and Datasets: the Taskonomy layout, the synthetic renderer, step-1 selection, the decoded cache.

The modules are imported explicitly (no discovery magic). Note that this package
shadows Hugging Face ``datasets`` for scripts run from the repository root.
"""

from datasets import cache, taskonomy, synthetic, selection  # noqa: F401
