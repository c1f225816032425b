"""``runwatch remediate``: run configured commands and post to webhooks for signed actions.

- ``config``: the YAML config's models (rules, commands, verify commands, webhooks, targets, vars,
  field patterns) and the checks that refuse a config that could run something unintended.
- ``templates``: argument templates, the allowed placeholders and filling them with values that
  are refused when unsafe.
- ``runner``: running a command or a verify command (no shell, timeout, secret-free environment)
  and judging a verify command's answer.
- ``notifications``: the Slack-compatible payload and posting it to a webhook.
- ``record``: one ``Execution`` per command run or webhook post, kept through ``RemediationStore``
  (the SQL is in :mod:`runwatch.sinks.clickhouse`).
- ``remediator``: ``Remediator``, what one action needs, taken through the shared action inbox.
- ``consumer``: ``RemediateConsumer``, the remediator on the action topic (group
  ``runwatch-remediate``), committing only what is recorded.

See docs/remediation.md. This file imports none of them.
"""
