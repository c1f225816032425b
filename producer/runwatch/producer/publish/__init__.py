"""Publishing one rank's telemetry: ``RunWatch`` (run_watch.py) composed of event building
(events.py), a delivery (delivery.py: to Kafka in kafka_delivery.py, its publisher thread, with the
client's settings and partitions in kafka_client.py, its books in delivery_books.py and its disk spool
in spool_replay.py and spool.py; or to a JSONL file in recorder.py) and run metadata (metadata.py);
run_end's status rules (run_end.py) and the LR a checkpoint records (lr.py)."""
