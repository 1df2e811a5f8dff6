"""Kafka helpers shared by the processor, the CLI and the local stack."""
