from rankscope.exporter.cli import main

raise SystemExit(main())
