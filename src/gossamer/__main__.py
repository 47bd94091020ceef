"""``python -m gossamer`` is the ``gossamer`` command."""

from gossamer.cli import main

raise SystemExit(main())
