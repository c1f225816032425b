"""Pure online detectors, their YAML config and the action policy.

Nothing here touches Kafka, ClickHouse, the network or the clock: callers pass events
(and their timestamps) in and get findings and action decisions back.
"""

from runwatch.detectors.config import ConfigError, RunwatchConfig, load_config
from runwatch.detectors.engine.monitor import MonitorOutput, RunMonitor
from runwatch.detectors.engine.policy import ActionDecision, ActionPolicy
from runwatch.detectors.findings import Finding
from runwatch.detectors.nonfinite import NonFiniteDetector
from runwatch.detectors.spike import SpikeDetector

__all__ = [
    "ActionDecision",
    "ActionPolicy",
    "ConfigError",
    "Finding",
    "MonitorOutput",
    "NonFiniteDetector",
    "RunMonitor",
    "RunwatchConfig",
    "SpikeDetector",
    "load_config",
]
