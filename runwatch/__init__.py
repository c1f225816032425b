"""runwatch: online regression detection and remediation for PyTorch training runs."""

__version__ = "0.1.0"
