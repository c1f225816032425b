"""Every action kind, declared once in ``contract/runwatch/contract/action_kinds.py``, runs the whole
way: a policy rule may name exactly the kinds the table says; each kind is issued (an ``Action``), signed,
accepted by the trainer's listener, applied by the handler the table names, acknowledged with an
``action_ack``, and shown in the report and the notifications in the table's colours, with a Grafana
annotation of its own; the docs' table says what the table says. A kind added to the table is picked up
here."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from runwatch.contract.action_kinds import ACTION_KINDS, POLICY_KINDS, ActionKindSpec
from runwatch.contract.schema import Action, CheckpointRef, utc_now
from runwatch.contract.signing import sign_action
from runwatch.detectors.config import PolicyRule
from runwatch.producer import MemoryDelivery
from runwatch.producer.actions.apply import ActionApplier
from runwatch.producer.actions.checkpoints import save_checkpoint
from runwatch.producer.actions.listener import ActionListener
from runwatch.producer.publish.run_watch import RunWatch
from runwatch.sinks.grafana.panels import RUN_DASHBOARD
from runwatch.sinks.remediate.notifications import slack_payload
from runwatch.sinks.report.panels import layout, mark_actions
from tests.support.action_keys import PUBLIC, WORKERS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"


def _issue(kind: str, target: CheckpointRef | None = None) -> Action:
    issued = utc_now()
    params = {"timeout_s": 0.05} if ACTION_KINDS[kind].applies == "pause" else {}
    if kind == "rollback":
        params = {"lr_scale": 0.5, "skip_steps": [11, 17]}
    action = Action(
        action_id=uuid.uuid4().hex,
        run_id="kinds",
        kind=kind,
        reason=f"a {kind}",
        step=17,
        onset_step=15,
        target_checkpoint=target,
        params=params,
        issued_at=issued,
        expires_at=issued + timedelta(seconds=60),
    )
    return sign_action(action, WORKERS)


@pytest.mark.parametrize("kind", list(ACTION_KINDS))
def test_every_kind_is_issued_signed_applied_acknowledged_and_shown(kind, tmp_path):
    spec = ACTION_KINDS[kind]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RunWatch(
        "kinds", "unused:9092", rank=0, world_size=1, collect_metadata=False, delivery=MemoryDelivery()
    )
    checkpoint = tmp_path / "step10.pt"
    save_checkpoint(str(checkpoint), model, optimizer, step=10)
    rw.checkpoint(10, str(checkpoint), lr=[0.1])
    listener = ActionListener(rw, model, optimizer, public_keys=PUBLIC.text, consume=False)
    try:
        action = _issue(kind, CheckpointRef(step=10, uri=str(checkpoint), lr=[0.1]))
        listener._accept(action.to_json())  # the signed bytes, as the consumer thread hands them over
        (applied,) = listener.poll(step=18)
        assert applied.kind == kind and applied.outcome == "applied", applied
        (ack,) = [e for e in rw.delivery.events if e.kind == "action_ack"]
        assert (ack.action_id, ack.action_kind, ack.outcome) == (action.action_id, kind, "applied")
        if spec.applies == "rollback":
            assert applied.to_step == 10 and ack.to_step == 10
            used: list[float] = []  # the LR the next update uses (the scale is held inside each step)
            optimizer.register_step_pre_hook(lambda o, _a, _k: used.append(o.param_groups[0]["lr"]))
            optimizer.step()
            assert used == pytest.approx([0.05]) and optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
        if spec.applies == "stop":
            assert rw.stopped_by == {"stop_action_id": action.action_id, "stop_cause": "stop"}
    finally:
        listener.close()
        rw.close(timeout=1)

    # the report: a line at the step it was taken, in the kind's colour
    fig = {"data": [], "layout": layout("loss")}
    mark_actions(
        fig,
        [
            {
                "kind": kind,
                "step": action.step,
                "ack_step": ack.step,
                "outcome": ack.outcome,
                "to_step": ack.to_step,
            }
        ],
    )
    (line,) = fig["layout"]["shapes"]
    assert line["x0"] == 18 and line["line"]["color"] == spec.color
    assert fig["layout"]["annotations"][0]["text"].startswith(kind)
    # the notification, in its chat colour; the run dashboard, an annotation of its own
    assert slack_payload(action)["attachments"][0]["color"] == spec.chat_color
    (mark,) = [a for a in RUN_DASHBOARD.annotations if a.name == f"Actions: {kind}"]
    assert f"kind = '{kind}'" in mark.sql and mark.color == spec.color


def test_each_way_of_applying_has_its_handler():
    assert {spec.applies for spec in ACTION_KINDS.values()} <= set(ActionApplier._HANDLERS)


@pytest.mark.parametrize("kind", list(ACTION_KINDS))
def test_a_policy_rule_may_name_a_kind_only_where_the_table_says(kind):
    rule = {"detector": "*", "min_severity": "warning", "action": kind}
    if ACTION_KINDS[kind].policy_rule:
        assert PolicyRule.model_validate(rule).action == kind
    else:
        with pytest.raises(ValidationError):
            PolicyRule.model_validate(rule)
    assert POLICY_KINDS == tuple(k for k, s in ACTION_KINDS.items() if s.policy_rule)


def docs_rows(kinds: dict[str, ActionKindSpec]) -> list[str]:
    """The docs table's rows as the table says they must read."""
    return [
        f"| `{name}` | {spec.order} | {'yes' if spec.policy_rule else 'no'} "
        f"| `{spec.applies}` | {spec.summary} |"
        for name, spec in kinds.items()
    ]


def _documented_rows(text: str) -> list[str]:
    start = text.index(
        "| kind | order | a policy rule may name it | applied by the trainer as | what it does |"
    )
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_docs_table_says_what_the_table_says():
    assert _documented_rows(DOCS.read_text()) == docs_rows(ACTION_KINDS)


def test_the_docs_check_fails_on_a_kind_the_docs_lack():
    added = {
        **ACTION_KINDS,
        "scratch": ActionKindSpec("scratch", 2, False, "note", False, "#777", "warning", "a throwaway kind"),
    }
    assert _documented_rows(DOCS.read_text()) != docs_rows(added)
    assert re.search(r"`scratch`", DOCS.read_text()) is None
