from umbp.cli import main

raise SystemExit(main())
