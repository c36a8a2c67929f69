"""`python -m agent` is the same as the `gpu-node-agent` command."""

import sys

from agent.cli import main

sys.exit(main())
