"""``RemediateConsumer``: the remediator on the action topic, a ``Sink`` (sinks/runwatch/sinks/base.py).

Consumes ``runwatch.actions`` in group ``runwatch-remediate`` on the shared consume, write durably,
commit loop (:mod:`runwatch.sinks.loop`): each record of a batch goes to the :class:`Remediator`
(through the shared action inbox), which returns once what it did is recorded in ClickHouse
``remediations``, so ``write_batch`` returns with all of the batch durable; Kafka offsets are committed
only after that. A ClickHouse that is down is retried until it answers (it ran, so keep trying to say
so). Run metadata (``run_start``) is looked up once per run, when an action needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runwatch.contract import topics
from runwatch.contract.schema import Action
from runwatch.contract.signing import ActionPublicKeys
from runwatch.sinks.base import Partition, Record, Sink
from runwatch.sinks.hosts import exclude_list
from runwatch.sinks.loop import ConsumeLoop, make_consumer, retry_durably
from runwatch.sinks.remediate.config import RemediationConfig
from runwatch.sinks.remediate.notifications import post_webhook
from runwatch.sinks.remediate.record import Execution, RemediationStore
from runwatch.sinks.remediate.remediator import Remediator
from runwatch.sinks.remediate.runner import run_command, run_verify

log = logging.getLogger(__name__)


class RemediateConsumer(Sink):
    """Consumes ``runwatch.actions`` in group ``runwatch-remediate`` until ``stopping`` is set;
    commits offsets only after what a batch needed is performed and recorded."""

    label = "remediate"

    def __init__(
        self,
        config: RemediationConfig,
        public_keys: ActionPublicKeys,
        store: RemediationStore,
        bootstrap: str,
        *,
        group_id: str = topics.REMEDIATE_GROUP,
        session_timeout_ms: int = 6000,
        runner: Callable[[list[str], float], tuple[str, int | None, str]] = run_command,
        poster: Callable[[str, dict[str, Any], float], tuple[str, int | None, str]] = post_webhook,
        verifier: Callable[[list[str], float], tuple[str, int | None, str, str]] = run_verify,
    ):
        super().__init__()
        self.store = store
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.session_timeout_ms = session_timeout_ms
        self.write_errors = 0
        self.commit_errors = 0
        self._meta: dict[str, Mapping[str, Any]] = {}
        self.remediator = Remediator(
            config,
            public_keys,
            record=self._record,
            lookup_run=self._lookup_run,
            done=store.done_keys(),
            runner=runner,
            poster=poster,
            verifier=verifier,
            excluded=self._excluded,
        )

    def _excluded(self, action: Action, meta: Mapping[str, Any]) -> list[str]:
        """The restart's own hosts, then its job's hosts that keep failing (none when the job is unknown)."""
        own = [h for h in action.params.get("exclude_hosts") or [] if isinstance(h, str)]
        job = meta.get("job_id") or self._lookup_run(action.run_id).get("job_id")
        if not isinstance(job, str) or not job:
            return own
        return exclude_list(self.store.sink, job, own)

    def _lookup_run(self, run_id: str) -> Mapping[str, Any]:
        if run_id not in self._meta:
            try:
                meta = self.store.run_metadata(run_id)
            except Exception as exc:  # noqa: BLE001 - the store's errors vary; placeholders needing it are
                # then refused, with the reason recorded
                log.warning("remediate: run_start lookup for %s failed: %s", run_id, exc)
                return {}
            if not meta:
                return {}  # not stored yet: ask again for the next action
            self._meta[run_id] = meta
        return self._meta[run_id]

    def _record(self, execution: Execution) -> None:
        # ClickHouse down: it ran, so keep trying to say so; never commit past it
        retry_durably(
            lambda: self.store.write(execution),
            stopping=self.stopping,
            errors=Exception,
            on_error=self._record_failed,
        )

    def _record_failed(self, exc: BaseException, delay: float) -> None:
        self.write_errors += 1
        log.warning("remediate: recording failed (%s); retrying in %.1fs", exc, delay)

    def write_batch(self, records: Sequence[Record]) -> dict[Partition, int]:
        """Every record handled and recorded: all of the batch is durable (a recording that keeps failing
        is retried until stopped, then raised: nothing is committed past it)."""
        for record in records:
            self.remediator.handle(record.value)  # returns once its executions are recorded
        return {}

    def commit_failed(self, exc: Exception) -> None:
        self.commit_errors += 1  # recorded already; a re-delivery finds it done

    def run(self) -> None:
        consumer = make_consumer(
            self.bootstrap,
            [topics.ACTIONS],
            group_id=self.group_id,
            session_timeout_ms=self.session_timeout_ms,
            client_id="runwatch-remediate",
            fetch_max_wait_ms=100,
        )
        ConsumeLoop(self, batch_size=100, drain=False).run(consumer)
