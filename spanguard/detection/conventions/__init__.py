"""Span conventions: how each instrumentation's spans are read (docs/conventions.md).

adapt.py maps a span to a guard event (events.py) with the attribute keys of keys.py; values.py
reads one attribute, decoding.py a call's arguments and result, kinds.py what a span is,
turns.py its conversation, gateway.py LiteLLM's proxy spans, and capture.py names the setting
that puts arguments on an instrumentation's spans. Each name is imported from its own module.
"""
