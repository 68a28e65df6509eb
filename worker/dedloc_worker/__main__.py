from dedloc_worker.cli import main

raise SystemExit(main())
