"""Framework callbacks that drive the ``Watcher`` from a framework's own hooks: PyTorch Lightning
(lightning.py) and the Hugging Face Trainer (hf.py). Each imports its framework: install the
``lightning`` or ``hf`` extra."""
