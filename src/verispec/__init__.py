"""verispec: lossless speculative decoding, with a statistical certificate of losslessness."""

__version__ = "0.1.0"
