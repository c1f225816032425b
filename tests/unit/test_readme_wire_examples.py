"""The README's wire examples are valid messages: someone publishing them by hand with kcat
must get them accepted, so every documented kind is checked against the schema."""

from __future__ import annotations

import math
import re
from pathlib import Path

from runwatch.producer.schema import EVENT_KINDS, decode_event

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_messages() -> list[str]:
    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_every_kind_has_a_valid_example():
    events = [decode_event(line) for line in readme_messages()]
    assert {e.kind for e in events} == set(EVENT_KINDS)
    nan_steps = [e for e in events if e.kind == "step" and e.loss is not None and math.isnan(e.loss)]
    assert nan_steps and math.isinf(nan_steps[0].grad_norm)


def test_kcat_example_is_valid():
    line = re.search(r"echo '([^|]+)\|(\{.*?\})'", README.read_text())
    key, value = line.group(1), line.group(2)
    event = decode_event(value)
    assert event.run_id == key and event.kind == "step"


def test_readme_configuration_block_is_the_defaults():
    import yaml

    from runwatch.detectors.config import RunwatchConfig

    block = re.search(r"```yaml\n(detectors:.*?)```", README.read_text(), flags=re.S).group(1)
    documented = RunwatchConfig.model_validate(yaml.safe_load(block))
    assert documented == RunwatchConfig()
