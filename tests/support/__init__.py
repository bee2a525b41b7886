"""What the tests share: span builders, the real-broker harness, local judge and Events API servers."""
