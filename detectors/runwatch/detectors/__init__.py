"""Pure online detectors, their YAML config and the action policy.

Nothing here touches Kafka, ClickHouse, the network or the clock: callers pass events
(and their timestamps) in and get findings and action decisions back.
"""

from runwatch.detectors import registry
from runwatch.detectors.base import Detector
from runwatch.detectors.config import ConfigError, RunwatchConfig, load_config
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.detectors.engine.output import MonitorOutput
from runwatch.detectors.engine.policy import ActionDecision, ActionPolicy
from runwatch.detectors.findings import Finding

__all__ = [
    "ActionDecision",
    "ActionPolicy",
    "ConfigError",
    "Detector",
    "Finding",
    "MonitorOutput",
    "RunMonitor",
    "RunwatchConfig",
    "load_config",
    "registry",
]
