"""`python -m spectrain`: the same commands as the `spectrain` script."""

from spectrain.cli import main

raise SystemExit(main())
