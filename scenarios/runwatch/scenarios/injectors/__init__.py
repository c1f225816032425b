"""Fault injectors, one module per family; ``base`` holds the hooks every injector has.
``runwatch.scenarios.faults`` hands every injector on from one place."""
