"""spanguard's tests; the folders mirror the source tree, `support/` holds the shared helpers."""
