from fedmq.experiments.cli import main

raise SystemExit(main())
