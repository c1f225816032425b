"""The documented wire examples (docs/wire-format.md) are valid messages: someone publishing them by
hand must get them accepted, so every documented kind is checked against the schema; the
documented limits are the ones in force; and the documented configuration (docs/configuration.md)
is the defaults."""

from __future__ import annotations

import math
import re
from pathlib import Path

from runwatch.contract.schema import EVENT_KINDS, decode_event

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
WIRE_DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"


def readme_messages() -> list[str]:
    blocks = re.findall(r"```json\n(.*?)```", WIRE_DOC.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_every_kind_has_a_valid_example():
    events = [decode_event(line) for line in readme_messages()]
    assert {e.kind for e in events} == set(EVENT_KINDS)
    nan_steps = [e for e in events if e.kind == "step" and e.loss is not None and math.isnan(e.loss)]
    assert nan_steps and math.isinf(nan_steps[0].grad_norm)


def test_documented_configuration_block_is_the_defaults():
    import yaml

    from runwatch.detectors.config import RunwatchConfig

    block = re.search(r"```yaml\n(detectors:.*?)```", CONFIG_DOC.read_text(), flags=re.S).group(1)
    loaded = yaml.safe_load(block)
    documented = RunwatchConfig.model_validate(loaded)
    assert documented == RunwatchConfig()
    # every setting is written out: a section or a knob left out would pass as its default
    for name, section in RunwatchConfig().detectors:
        assert set(loaded["detectors"].get(name, {})) == set(type(section).model_fields), name


def test_every_limit_is_documented_with_its_default():
    from runwatch.contract.schema import WireLimits

    text = WIRE_DOC.read_text()
    table = text[text.index("| limit | default | what it bounds |") :]
    table = table[: table.index("\n\n")]  # the limits table, up to the blank line after it
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
    assert set(rows) == set(WireLimits.model_fields)
    for name, field in WireLimits.model_fields.items():
        documented = rows[name].split("(")[0].strip().replace(",", "")
        value = field.default
        if "^" in documented:
            base, exp = documented.split("^")
            assert value == int(base) ** int(exp), name
        else:
            assert float(documented) == value, name


def test_every_field_that_declares_a_limit_is_named_in_its_row():
    from runwatch.contract.limit_checks import bounded_fields
    from runwatch.contract.schema import EVENT_MODELS

    text = WIRE_DOC.read_text()
    table = text[text.index("| limit | default | what it bounds |") :]
    table = table[: table.index("\n\n")]
    bounds = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", table, flags=re.M))
    declared = [
        (bound.limit, name)
        for model in EVENT_MODELS
        for name, bound in bounded_fields(model)
        if isinstance(bound.limit, str)
    ]
    assert declared
    for limit, name in declared:
        assert f"`{name}`" in bounds[limit], (limit, name)
