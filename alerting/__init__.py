"""Paging the on-call and notifying webhooks: PagerDuty incidents (pagerduty.py) and JSON or
Slack webhooks (webhook.py), both on the one outbound HTTP loop (connectors/outbound.py)."""

# Installed as spanguard.alerting; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.alerting":
    raise ImportError(f"import spanguard.alerting, not {__name__}")
