from nvpair.cli.main import main

raise SystemExit(main())
