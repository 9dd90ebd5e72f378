from rankscope.console.cli import main

raise SystemExit(main())
