"""The PyTorch Lightning callback at the path docs before issue 13 gave, kept so that training scripts
importing it from here go on working: it lives in :mod:`runwatch.producer.integrations.lightning`."""

from runwatch.producer.integrations.lightning import RunWatchCallback

__all__ = ["RunWatchCallback"]
