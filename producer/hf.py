"""The Hugging Face Trainer callback at the path docs before issue 13 gave, kept so that training scripts
importing it from here go on working: it lives in :mod:`runwatch.producer.integrations.hf`."""

from runwatch.producer.integrations.hf import RunWatchCallback

__all__ = ["RunWatchCallback"]
