"""The Faust worker, the `runwatch` command line, the local stack, the demo and the scenario corpus."""
