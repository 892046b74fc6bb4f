"""`python -m fedmq.experiments.cli`: the `fedmq` command, as when this was one module."""

from fedmq.experiments.cli import main

raise SystemExit(main())
