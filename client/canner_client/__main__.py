from canner_client.cli import main

raise SystemExit(main())
