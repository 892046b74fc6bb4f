"""`python -m fedmq`: the `fedmq` command."""

from fedmq.experiments.cli import main

raise SystemExit(main())
