"""What the worker and its tools read from outside the code: the settings registry (settings.py,
from variables and flags), secrets read from variables and files (secrets.py), the policy file
(policy_file.py) and the Kafka TLS and SASL settings every client shares (kafka_security.py)."""

# Installed as spanguard.config; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.config":
    raise ImportError(f"import spanguard.config, not {__name__}")
