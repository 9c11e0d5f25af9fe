"""tpe-train: encoder-decoder Transformers with interchangeable position encodings."""

__version__ = "0.1.0"
