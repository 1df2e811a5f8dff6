"""``python -m processor`` is the ``toolsentry`` command."""

from processor.cli import main

main()
