from spectrain.cli import main

raise SystemExit(main())
