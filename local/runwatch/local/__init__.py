"""What runs on one machine for the demo and the tests: the embedded broker, the outage proxy, a worker
process."""
