"""`python -m spanguard.detection.rules`: the README's rule table, from the registry."""

from spanguard.detection.rules import markdown_table

print(markdown_table(), end="")
