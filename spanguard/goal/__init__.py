"""Goal verification: did a finished agent invocation do what was asked (pure parts; the judge is injected)."""
