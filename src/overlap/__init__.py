"""overlap: PyTorch training for transformer and MoE models built around communication/computation
overlap."""

__version__ = "0.1.0"
