"""The detectors away from the stream: ``replay`` a recording on event time, ``evaluate`` a labelled
corpus (recall, delays, false alarms), ``calibrate`` a detector's sensitivity on it."""
