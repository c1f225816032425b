"""The Faust worker, the embedded broker, the demo and the ``runwatch`` command line."""
