from coldset.cli import main

raise SystemExit(main())
