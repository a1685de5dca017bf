"""Training data: sources, tokenizers, chat rendering, packing, the resumable sampler, loaders.

The names most callers need are here; each module says what it holds."""

from core.data.build import build_dataset, dataset_fingerprint, sample_lengths
from core.data.collate import collate
from core.data.errors import DataError
from core.data.tokenizers import HFTokenizer, load_tokenizer

__all__ = [
    "DataError",
    "HFTokenizer",
    "build_dataset",
    "collate",
    "dataset_fingerprint",
    "load_tokenizer",
    "sample_lengths",
]
