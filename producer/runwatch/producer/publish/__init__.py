"""Publishing one rank's telemetry: ``RunWatch`` (run_watch.py) composed of event building
(events.py), a delivery (delivery.py: to Kafka with its disk spool in kafka_delivery.py and
spool.py, or to a JSONL file in recorder.py) and run metadata (metadata.py); run_end's status
rules (run_end.py) and the LR a checkpoint records (lr.py)."""
