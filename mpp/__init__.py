"""mpp: masked patch prediction pre-training of Vision Transformers on WebDataset shards."""
__version__ = "0.1.0"
