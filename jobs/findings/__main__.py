from jobs.findings.cli import main

raise SystemExit(main())
