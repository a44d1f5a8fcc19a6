"""``python -m gateway`` behaves exactly like the ``rollout-gateway`` console script."""

import sys

from gateway.cli import main

sys.exit(main())
