"""The local development stack (one Kafka broker, one redis-server) without Docker."""

from processor.stack.local import LocalStack, free_ports, private_stack_settings
from processor.stack.process import ServiceStatus, StackError

__all__ = ["LocalStack", "ServiceStatus", "StackError", "free_ports", "private_stack_settings"]
