"""Labelled training scenarios: the catalog, the fault injectors, the tasks, clocks and memory model, and the
recorded corpus."""
